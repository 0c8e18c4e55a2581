"""Compressed source formats of the DeepSeek-V3 text family, decoded as they load: block-FP8 (DeepSeek-V3/R1,
Kimi-K2) and INT4 pack-quantized routed experts (Kimi-K2.5/K2.6), as transformers ``WeightConverter`` chains.
Shared by ``deepseek_v3`` and ``kimi_k25`` (whose text model is DeepSeek-V3's): no model package imports another.

- ``quant_method: fp8`` (``weight_block_size [bm, bn]``): every decoder Linear stores ``weight`` float8_e4m3fn
  + ``weight_scale_inv``; embeddings, lm_head, norms, the router and its bias are stored plain. Dense
  Linears decode through ``DENSE_FP8_CONVERTERS`` (two source keys -> one parameter), routed experts
  through the experts chain (decode, stack, concatenate gate/up) straight into this rank's rows.
- compressed-tensors ``pack-quantized`` INT4 (group 32, symmetric) on the routed experts only:
  ``weight_packed`` int32 / ``weight_scale`` / ``weight_shape`` per expert Linear, everything else BF16.

The block-FP8 decode is the shared one (``models/common/block_fp8.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.core_model_loading import ConversionOps, WeightConverter

from ...numerics.int4_packed import int4_packed_decode
from ...spec import SpecError
from ...spec.conversion import DecodeOp
from .block_fp8 import (
    FP8,
    FP8_QUANT_METHOD,
    FP8_SCALE,
    BlockFp8Decode,
    fused_experts_converters,
    quantization_config,
    weight_block_size,
)

INT4, INT4_SCALE, INT4_SHAPE = "weight_packed", "weight_scale", "weight_shape"
# The decoder's Linears outside the routed experts (DeepseekV3Attention, DeepseekV3MLP: dense layers and
# shared experts). Anchored on the module's own names so a routed expert's key never matches.
_DENSE_LINEAR = (r"((?:self_attn\.(?:q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj))"
                 r"|(?:mlp\.(?:shared_experts\.)?(?:gate_proj|up_proj|down_proj)))")


class Int4PackedDecode(DecodeOp):
    """``weight_packed`` + ``weight_scale`` (+ ``weight_shape``, checked) -> the decoded weight, group 32."""

    codes_field, scales_field, shape_field = INT4, INT4_SCALE, INT4_SHAPE

    def __init__(self, group_size: int = 32, dtype: torch.dtype = torch.bfloat16) -> None:
        self.group_size, self.dtype = group_size, dtype

    def decoded_shape(self, codes_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*codes_shape[:-1], codes_shape[-1] * 8)  # eight 4-bit values a word

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None):
        return int4_packed_decode(codes, scales, scales.shape[-1] * self.group_size, self.group_size, dtype, out=out)

    @torch.no_grad()
    def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                **kwargs) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for pattern in [p for p in source_patterns if p.endswith(INT4)]:
            head = pattern[: -len(INT4)]
            packed, scales = input_dict.pop(pattern), input_dict.pop(head + INT4_SCALE)
            shapes = input_dict.pop(head + INT4_SHAPE, None)
            dtype = kwargs.get("dtype") or self.dtype  # the parameter's dtype, as the in-place decode uses
            decoded = [self.decode(p, s, dtype) for p, s in zip(packed, scales, strict=True)]
            for d, shape in zip(decoded, shapes or [], strict=False):
                if list(shape.tolist()) != list(d.shape):
                    raise SpecError(f"{kwargs.get('full_layer_name')}: weight_shape {shape.tolist()} != decoded "
                                    f"{list(d.shape)}")
            out[pattern] = decoded
        return out

    @property
    def reverse_op(self) -> ConversionOps:
        raise NotImplementedError("modelopt_k3 exports through its own writer, never by reversing the load")


def source_kind(config: Any, model: str = "DeepSeek-V3") -> str:
    """``"bf16"`` (no quantization_config), ``"block_fp8"`` or ``"int4"`` (compressed-tensors
    pack-quantized experts); any other declared format is refused (``model`` names the spec in the message)."""
    qcfg = quantization_config(config)
    if qcfg is None:
        return "bf16"
    method = qcfg.get("quant_method")
    if method == FP8_QUANT_METHOD:
        weight_block_size(config)
        return "block_fp8"
    if method == "compressed-tensors" and qcfg.get("format") == "pack-quantized":
        int4_group_size(config)
        return "int4"
    raise SpecError(f"the {model} spec reads BF16, block-FP8 (quant_method 'fp8') and compressed-tensors "
                    f"pack-quantized INT4 checkpoints; this one declares quant_method {method!r}, format "
                    f"{qcfg.get('format')!r}")


def experts_converters(source: str, config: Any) -> list[WeightConverter]:
    """Per-expert checkpoint Linears -> ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` for a ``source``
    of ``"bf16"``, ``"block_fp8"`` or ``"int4"`` (pack-quantized): transformers' ``qwen2_moe`` chain
    (which it applies to ``deepseek_v3``) with the decode in front."""
    if source == "block_fp8":
        fields, head = (FP8, FP8_SCALE), [BlockFp8Decode(weight_block_size(config))]
    elif source == "int4":
        fields, head = (INT4, INT4_SCALE, INT4_SHAPE), [Int4PackedDecode(int4_group_size(config))]
    else:
        fields, head = (FP8,), []
    return fused_experts_converters("mlp.experts", ("gate_proj", "up_proj"), "down_proj", fields, head)


def int4_group_size(config: Any) -> int:
    """The INT4 experts' group size from the compressed-tensors config (symmetric int4 group only)."""
    qcfg = quantization_config(config) or {}
    groups = qcfg.get("config_groups") or {}
    for group in groups.values():
        w = group.get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("strategy"), w.get("symmetric", True)) == (4, "int", "group", True):
            return int(w["group_size"])
    raise SpecError(f"INT4 experts need a compressed-tensors pack-quantized group (num_bits 4, type int, strategy "
                    f"group, symmetric); config.json quantization_config has {groups!r}")


DENSE_FP8_CONVERTERS = (
    WeightConverter(source_patterns=[_DENSE_LINEAR + r"\.weight$", _DENSE_LINEAR + r"\.weight_scale_inv$"],
                    target_patterns=r"\1.weight", operations=[BlockFp8Decode()]),
)
