"""Tests of modelopt_k3.numerics (the tests tree mirrors the package)."""
