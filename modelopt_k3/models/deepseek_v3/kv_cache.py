"""Where DeepSeek-V3's MLA layers keep their KV cache (the quantization layer attaches the FP8 scale).

An MLA server caches the compressed latent, not per-head K and V: ``kv_a_layernorm(c)`` (``kv_lora_rank``
wide) and the shared rope key, the last ``qk_rope_head_dim`` columns of ``kv_a_proj_with_mqa``'s output, in
one entry with one scale. So one amax is observed over both and exported as ``self_attn.k_proj.k_scale`` and
``self_attn.v_proj.v_scale`` (equal), the names ModelOpt gives its MLA ``k/v_bmm_quantizer`` scales and that
vLLM's ``maybe_remap_kv_scale_name`` moves onto its attention layer: the same rule as Kimi-K3's MLA
(``models/kimi_k3/kv_cache.py``), on transformers' ``DeepseekV3Attention`` (same attribute names).
"""

from __future__ import annotations

from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

from ...spec.kv_cache import CachedOutput, KvCacheSite

KV_SCALE_NAMES = ("k_proj.k_scale", "v_proj.v_scale")


def kv_cache_sites(model: nn.Module) -> list[KvCacheSite]:
    """One site per MLA layer: the whole normalised latent and the rope slice of ``kv_a_proj_with_mqa``."""
    return [
        KvCacheSite(
            module,
            (CachedOutput(module.kv_a_layernorm), CachedOutput(module.kv_a_proj_with_mqa, start=module.kv_lora_rank)),
            KV_SCALE_NAMES,
        )
        for module in model.modules()
        if isinstance(module, DeepseekV3Attention)
    ]


def kv_scale_names(config: dict) -> list[str]:
    """The KV-cache scales the exporter writes: one pair per decoder layer (every layer is MLA)."""
    return [f"model.layers.{i}.self_attn.{key}" for i in range(int(config.get("num_hidden_layers", 0)))
            for key in KV_SCALE_NAMES]
