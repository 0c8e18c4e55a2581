"""Tests of modelopt_k3.dist (the tests tree mirrors the package)."""
