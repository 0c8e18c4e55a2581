"""Tests of modelopt_k3.experts (the tests tree mirrors the package)."""
