"""Tests of modelopt_k3.models (the tests tree mirrors the package)."""
