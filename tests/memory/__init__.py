"""Tests of modelopt_k3.memory (the tests tree mirrors the package)."""
