"""Tests of modelopt_k3.quant (the tests tree mirrors the package)."""
