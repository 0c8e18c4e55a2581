"""Tiny Kimi-K3 stand-in checkpoints for tests and examples."""

from modelopt_k3.testing.tiny import TINY_DEFAULTS, generator_fingerprint, make_tiny_kimi_k3

__all__ = ["TINY_DEFAULTS", "generator_fingerprint", "make_tiny_kimi_k3"]
