"""Where Kimi-K2.5's MLA layers keep their KV cache: the shared MLA site (``models/common/kv_cache.py``) on
transformers' ``DeepseekV3Attention`` inside ``language_model``; every decoder layer is MLA."""

from __future__ import annotations

from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

from ...spec.kv_cache import KvCacheSite
from ..common.kv_cache import mla_kv_cache_sites, mla_kv_scale_names


def kv_cache_sites(model: nn.Module) -> list[KvCacheSite]:
    return mla_kv_cache_sites(model, lambda module: isinstance(module, DeepseekV3Attention))


def kv_scale_names(config: dict) -> list[str]:
    text = config.get("text_config") or {}
    return mla_kv_scale_names("language_model.model.layers", list(range(int(text.get("num_hidden_layers", 0)))))
