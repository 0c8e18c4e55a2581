"""Tests of modelopt_k3.export (the tests tree mirrors the package)."""
