"""Dotted module and tensor names (``model.layers.3.mlp.experts.gate_up_proj``): what lies under what.

One definition of "under a module" and "the enclosing module", shared by the loader's read scopes, the
layerwise export's parts, the coverage guard and the planner's per-layer estimate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

__all__ = ["enclosing", "is_under", "under_any"]


def is_under(name: str, prefix: str) -> bool:
    """``name`` is the module ``prefix`` or lies inside it; the empty prefix (the root) holds every name."""
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def under_any(name: str, prefixes: Iterable[str]) -> bool:
    return any(is_under(name, p) for p in prefixes)


def enclosing(name: str, is_module: Callable[[str], bool]) -> str | None:
    """The shortest dotted prefix of ``name`` (``name`` itself included) that ``is_module`` accepts, else None."""
    parts = name.split(".")
    for n in range(1, len(parts) + 1):
        prefix = ".".join(parts[:n])
        if is_module(prefix):
            return prefix
    return None
