"""Tests of modelopt_k3.convert (the tests tree mirrors the package)."""
