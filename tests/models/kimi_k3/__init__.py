"""Tests of modelopt_k3.models.kimi_k3 (the tests tree mirrors the package)."""
