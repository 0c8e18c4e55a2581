"""Tests of modelopt_k3.check (the tests tree mirrors the package)."""
