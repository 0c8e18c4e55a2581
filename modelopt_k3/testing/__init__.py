"""Tiny stand-in checkpoints for tests and examples (one generator per model, named by its spec)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from modelopt_k3.testing.tiny import TINY_DEFAULTS, generator_fingerprint, make_tiny_kimi_k3

__all__ = ["TINY_DEFAULTS", "generator_fingerprint", "make_tiny", "make_tiny_kimi_k3"]


def make_tiny(model_type: str, path: str | Path, **sizes: Any) -> Path:
    """Write the tiny stand-in checkpoint of ``model_type`` (its spec's ``stand_in``) at ``path``."""
    from modelopt_k3.spec import SpecError, get_spec

    spec = get_spec(model_type)
    if spec.stand_in is None:
        raise SpecError(f"model_type {model_type!r} declares no tiny stand-in (ModelSpec.stand_in)")
    return spec.stand_in(path, **sizes)
