"""Where an MLA attention layer keeps its KV cache (the quantization layer attaches the FP8 scale).

What an MLA server caches is the compressed latent, not per-head K and V: the normalised
``kv_a_layernorm(c)`` (``kv_lora_rank`` wide) and the shared rope key, the last ``qk_rope_head_dim`` columns of
``kv_a_proj_with_mqa``'s output, in one entry with one scale. So one amax is observed over both and exported as
``self_attn.k_proj.k_scale`` and ``self_attn.v_proj.v_scale`` (equal): the names ModelOpt gives its MLA
``k_bmm_quantizer``/``v_bmm_quantizer`` scales (checked by running nvidia-modelopt 0.47.0's export on the tiny
Kimi-K3); MLA has no ``k_proj`` module, the name is a convention (vLLM and SGLang drop these scales on their
MLA layers and serve the FP8 cache with scale 1.0: docs/SERVING.md). transformers' ``DeepseekV3Attention`` and Kimi-K3's remote
``KimiMLAAttention`` use the same attribute names, so one rule serves both.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ...spec.kv_cache import CachedOutput, KvCacheSite

KV_SCALE_NAMES = ("k_proj.k_scale", "v_proj.v_scale")


def mla_kv_cache_sites(model: nn.Module, is_mla: Callable[[nn.Module], bool]) -> list[KvCacheSite]:
    """One site per MLA layer (``is_mla``): the whole normalised latent and the rope slice of
    ``kv_a_proj_with_mqa``."""
    return [
        KvCacheSite(
            module,
            (CachedOutput(module.kv_a_layernorm), CachedOutput(module.kv_a_proj_with_mqa, start=module.kv_lora_rank)),
            KV_SCALE_NAMES,
        )
        for module in model.modules()
        if is_mla(module)
    ]


def mla_kv_scale_names(layers_prefix: str, mla_layers: list[int]) -> list[str]:
    """The KV-cache scales the exporter writes: one pair per MLA layer, ``{layers_prefix}.{i}.self_attn.*``."""
    return [f"{layers_prefix}.{i}.self_attn.{key}" for i in mla_layers for key in KV_SCALE_NAMES]
