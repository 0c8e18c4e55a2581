"""Where DeepSeek-V3's MLA layers keep their KV cache: the shared MLA site (``models/common/kv_cache.py``) on
transformers' ``DeepseekV3Attention``; every decoder layer is MLA."""

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
    return mla_kv_scale_names("model.layers", list(range(int(config.get("num_hidden_layers", 0)))))
