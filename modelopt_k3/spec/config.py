"""Reading a model's config.json fields the way every spec's source check needs them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .contract import SpecError

__all__ = ["positive_int"]


def positive_int(config: Mapping[str, Any], name: str, *, label: str | None = None) -> int:
    """``config[name]`` as a positive int (a bool is no int here), else ``SpecError`` quoting the value under
    ``label`` (default ``config.json <name>``)."""
    value = config.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SpecError(f"{label or f'config.json {name}'} = {value!r}; a positive integer is needed")
    return value
