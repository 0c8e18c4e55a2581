"""Where a model's KV cache is: the declaration a model adapter gives the quantization layer.

The adapter says which module outputs enter the cache (and which columns of them) and under which
names the cache's scales are exported; the quantization layer (``quant/kv_cache.py``) attaches the
quantizer and its hooks. The adapter never imports the quantization layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class CachedOutput:
    """A module whose output (from column ``start`` of its last dim on; None: all of it) is cached."""

    module: nn.Module
    start: int | None = None


@dataclass(frozen=True)
class KvCacheSite:
    """One attention layer's cache entry: the outputs it caches (one scale over all of them) and the
    export names of that scale, relative to ``attention``."""

    attention: nn.Module
    outputs: tuple[CachedOutput, ...]
    scale_names: tuple[str, ...]
