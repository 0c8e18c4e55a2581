"""Where Kimi-K3's MLA layers keep their KV cache: the shared MLA site (``models/common/kv_cache.py``) on the
remote ``KimiMLAAttention`` (matched by name: remote classes are not importable here). KDA layers keep a
recurrent state, not a KV cache; they get no scales."""

from __future__ import annotations

from torch import nn

from ...spec.kv_cache import KvCacheSite
from ..common.kv_cache import mla_kv_cache_sites, mla_kv_scale_names

MLA_CLASS = "KimiMLAAttention"


def kv_cache_sites(model: nn.Module) -> list[KvCacheSite]:
    return mla_kv_cache_sites(model, lambda module: type(module).__name__ == MLA_CLASS)


def kv_scale_names(config: dict) -> list[str]:
    """One pair per MLA layer: every layer not in ``linear_attn_config.kda_layers`` (1-indexed)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    kda = set((text.get("linear_attn_config") or {}).get("kda_layers") or [])
    layers = [i for i in range(int(text.get("num_hidden_layers", 0))) if i + 1 not in kda]
    return mla_kv_scale_names("language_model.model.layers", layers)
