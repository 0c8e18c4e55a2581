"""FP8 KV-cache scales for Kimi-K3's MLA layers.

What an MLA server caches is the compressed latent, not per-head K and V: the normalised
``kv_a_layernorm(c)`` (kv_lora_rank) and the shared ``k_rot`` (qk_rope_head_dim) slice of
``kv_a_proj_with_mqa``'s output. Both live in one cache entry with one scale, so we observe one amax
over both and export it as ``self_attn.k_proj.k_scale`` and ``self_attn.v_proj.v_scale`` (``amax / 448``,
equal): the names ModelOpt gives its ``k_bmm_quantizer``/``v_bmm_quantizer`` scales (checked by running
nvidia-modelopt 0.47.0's export on the tiny Kimi-K3) and the ones vLLM's ``maybe_remap_kv_scale_name``
moves onto its attention layer (MLA has no ``k_proj`` module; the name is a convention).
KDA layers keep a recurrent state, not a KV cache; they get no scales.
"""

from __future__ import annotations

import torch
from torch import nn

from ...quant.quantizer import TensorQuantizer

MLA_CLASS = "KimiMLAAttention"
KV_SCALE_NAMES = ("k_proj.k_scale", "v_proj.v_scale")


def _rope_slice_hook(quantizer: TensorQuantizer, kv_lora_rank: int):
    def hook(module, args, output):
        if quantizer.mode == "off":
            return None
        rot = output[..., kv_lora_rank:]
        new = quantizer(rot)
        if quantizer.mode != "quant":
            return None
        return torch.cat([output[..., :kv_lora_rank], new], dim=-1)

    return hook


def _whole_output_hook(quantizer: TensorQuantizer):
    def hook(module, args, output):
        out = quantizer(output)
        return out if quantizer.mode == "quant" else None

    return hook


def attach_kv_cache(model: nn.Module, fmt: str) -> None:
    if fmt != "fp8":
        raise ValueError(f"Kimi-K3 supports KV cache format 'fp8', not {fmt!r}")
    found = 0
    for module in model.modules():
        if type(module).__name__ != MLA_CLASS:
            continue
        q = TensorQuantizer("fp8", role="input").to(module.kv_a_layernorm.weight.device)
        module.kv_cache_quantizer = q
        module.kv_a_layernorm.register_forward_hook(_whole_output_hook(q))
        module.kv_a_proj_with_mqa.register_forward_hook(_rope_slice_hook(q, module.kv_lora_rank))
        module.kv_scale_names = KV_SCALE_NAMES
        module.kv_scale = lambda key, q=q: q.scale().reshape(()).to(torch.float32).cpu()
        found += 1
    if not found:
        raise ValueError("kv_cache=fp8 was requested but the model has no MLA attention layer")
