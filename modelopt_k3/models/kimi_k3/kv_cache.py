"""Where Kimi-K3's MLA layers keep their KV cache (the quantization layer attaches the FP8 scales).

What an MLA server caches is the compressed latent, not per-head K and V: the normalised
``kv_a_layernorm(c)`` (kv_lora_rank) and the shared ``k_rot`` (qk_rope_head_dim) slice of
``kv_a_proj_with_mqa``'s output. Both live in one cache entry with one scale, so one amax is observed
over both and exported as ``self_attn.k_proj.k_scale`` and ``self_attn.v_proj.v_scale`` (equal): the
names ModelOpt gives its ``k_bmm_quantizer``/``v_bmm_quantizer`` scales (checked by running
nvidia-modelopt 0.47.0's export on the tiny Kimi-K3) and the ones vLLM's ``maybe_remap_kv_scale_name``
moves onto its attention layer (MLA has no ``k_proj`` module; the name is a convention).
KDA layers keep a recurrent state, not a KV cache; they get no scales.
"""

from __future__ import annotations

from torch import nn

from ...spec.kv_cache import CachedOutput, KvCacheSite

MLA_CLASS = "KimiMLAAttention"
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
        if type(module).__name__ == MLA_CLASS
    ]


def kv_scale_names(config: dict) -> list[str]:
    """The KV-cache scales the exporter writes: one pair per MLA layer (every layer not in kda_layers)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    kda = set((text.get("linear_attn_config") or {}).get("kda_layers") or [])  # 1-indexed
    return [f"language_model.model.layers.{i}.self_attn.{key}"
            for i in range(int(text.get("num_hidden_layers", 0))) if i + 1 not in kda for key in KV_SCALE_NAMES]
