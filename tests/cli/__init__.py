"""Tests of modelopt_k3.cli (the tests tree mirrors the package)."""
