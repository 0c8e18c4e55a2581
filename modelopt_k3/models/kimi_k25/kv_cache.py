"""Where Kimi-K2.5's MLA layers keep their KV cache: the shared MLA site (``models/common/kv_cache.py``) on
transformers' ``DeepseekV3Attention`` inside ``language_model``; every decoder layer is MLA."""

from __future__ import annotations

from torch import nn

from ...spec.kv_cache import KvCacheSite
from ..common.kv_cache import mla_kv_cache_sites, mla_kv_scale_names
from ..common.lazy import modeling_class

ATTENTION = modeling_class("deepseek_v3", "DeepseekV3Attention")  # imported with the model it finds sites in


def kv_cache_sites(model: nn.Module) -> list[KvCacheSite]:
    attention = ATTENTION()
    return mla_kv_cache_sites(model, lambda module: isinstance(module, attention))


def kv_scale_names(config: dict) -> list[str]:
    text = config.get("text_config") or {}
    return mla_kv_scale_names("language_model.model.layers", list(range(int(text.get("num_hidden_layers", 0)))))
