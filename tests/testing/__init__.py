"""Tests of modelopt_k3.testing (the tests tree mirrors the package)."""
