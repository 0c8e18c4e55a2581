"""Tests of modelopt_k3.recipe (the tests tree mirrors the package)."""
