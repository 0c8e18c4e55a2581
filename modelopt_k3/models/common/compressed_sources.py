"""Compressed source formats of the DeepSeek-V3 text family, decoded as they load: block-FP8 (DeepSeek-V3/R1,
Kimi-K2) and INT4 pack-quantized routed experts (Kimi-K2.5/K2.6), as transformers ``WeightConverter`` chains.
Shared by ``deepseek_v3`` and ``kimi_k25`` (whose text model is DeepSeek-V3's): no model package imports another.

- ``quant_method: fp8`` (``weight_block_size [bm, bn]``): every decoder Linear stores ``weight`` float8_e4m3fn
  + ``weight_scale_inv``; embeddings, lm_head, norms, the router and its bias are stored plain. Dense
  Linears decode through ``DENSE_FP8_CONVERTERS`` (two source keys -> one parameter), routed experts
  through the experts chain (decode, stack, concatenate gate/up) straight into this rank's rows.
- compressed-tensors ``pack-quantized`` INT4 (group 32, symmetric) on the routed experts only:
  ``weight_packed`` int32 / ``weight_scale`` / ``weight_shape`` per expert Linear, everything else BF16.

The block is the declared ``weight_block_size`` (``numerics.block_fp8``), read from the model's config when
the op runs; a source without it is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers.core_model_loading import Concatenate, ConversionOps, MergeModulelist, WeightConverter

from ...numerics.block_fp8 import block_fp8_decode
from ...numerics.int4_packed import int4_packed_decode
from ...spec import SpecError
from ...spec.conversion import DecodeOp

FP8, FP8_SCALE = "weight", "weight_scale_inv"
FP8_QUANT_METHOD = "fp8"  # quantization_config.quant_method of a block-FP8 checkpoint
INT4, INT4_SCALE, INT4_SHAPE = "weight_packed", "weight_scale", "weight_shape"
# The decoder's Linears outside the routed experts (DeepseekV3Attention, DeepseekV3MLP: dense layers and
# shared experts). Anchored on the module's own names so a routed expert's key never matches.
_DENSE_LINEAR = (r"((?:self_attn\.(?:q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj))"
                 r"|(?:mlp\.(?:shared_experts\.)?(?:gate_proj|up_proj|down_proj)))")


def quantization_config(config: Any) -> Mapping[str, Any] | None:
    qcfg = getattr(config, "quantization_config", None)
    if qcfg is None or isinstance(qcfg, Mapping):
        return qcfg
    return qcfg.to_dict() if hasattr(qcfg, "to_dict") else vars(qcfg)


def weight_block_size(config: Any) -> tuple[int, int]:
    """The declared ``weight_block_size`` of a block-FP8 source (SpecError when the config does not declare one)."""
    qcfg = quantization_config(config) or {}
    block = qcfg.get("weight_block_size")
    if qcfg.get("quant_method") != FP8_QUANT_METHOD or not isinstance(block, (list, tuple)) or len(block) != 2:
        raise SpecError(f"block-FP8 weights need quantization_config quant_method 'fp8' with a weight_block_size "
                        f"[bm, bn]; config.json has {dict(qcfg)!r}")
    return int(block[0]), int(block[1])


def _first(value):
    return value[0] if isinstance(value, list) else value


class BlockFp8Decode(DecodeOp):
    """``weight`` + ``weight_scale_inv`` -> the decoded weight (``numerics.block_fp8``), per source tensor."""

    codes_field, scales_field = FP8, FP8_SCALE

    def __init__(self, block_size: tuple[int, int] | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
        self.block_size, self.dtype = block_size, dtype

    def decoded_shape(self, codes_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(codes_shape)  # one byte, one value

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None):
        if self.block_size is None:
            raise SpecError("BlockFp8Decode has no weight_block_size (prepare sets it from config.json)")
        return block_fp8_decode(codes, scales, self.block_size, dtype, out=out)

    def block_fp8_block(self, config: Any) -> tuple[int, int]:
        return self.block_size or weight_block_size(config)  # the dense converter's: read from config.json

    @torch.no_grad()
    def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                **kwargs) -> dict[str, Any]:
        """Each ``weight`` pattern's tensors decoded with their ``weight_scale_inv`` (same order), under the
        weight pattern; a ``weight`` stored without a scale (a BF16 source) is only cast."""
        model = kwargs.get("model")
        out: dict[str, Any] = {}
        for pattern, value in input_dict.items():
            if FP8_SCALE in pattern:
                continue
            scale_pattern = next((p for p in source_patterns if p != pattern and _is_scale_of(p, pattern)), None)
            if scale_pattern is None or scale_pattern not in input_dict:
                if any(t.dtype == torch.float8_e4m3fn for t in (value if isinstance(value, list) else [value])):
                    raise SpecError(f"{kwargs.get('full_layer_name')}: a float8 weight without its weight_scale_inv")
                out[pattern] = value
                continue
            if self.block_size is None and model is None:
                raise SpecError("block-FP8 decode needs the model's config (weight_block_size)")
            block = self.block_size or weight_block_size(model.config)
            weights, scales = input_dict[pattern], input_dict[scale_pattern]
            dtype = kwargs.get("dtype") or self.dtype  # the parameter's: fp8 x scale_inv in fp32, one cast to it
            try:
                if isinstance(weights, list):
                    out[pattern] = [block_fp8_decode(w, s, block, dtype) for w, s in zip(weights, scales, strict=True)]
                else:
                    out[pattern] = block_fp8_decode(weights, scales, block, dtype)
            except ValueError as e:  # a scale of the wrong shape: named by the layer it decodes
                raise ValueError(f"{kwargs.get('full_layer_name')}: {e}") from None
        return out

    @property
    def reverse_op(self) -> ConversionOps:
        raise NotImplementedError("modelopt_k3 exports through its own writer, never by reversing the load")


def _is_scale_of(scale_pattern: str, weight_pattern: str) -> bool:
    base = weight_pattern.removesuffix("$")
    return scale_pattern.removesuffix("$") in (base + "_scale_inv", base.removesuffix(FP8) + FP8_SCALE)


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

    def patterns(*projs: str) -> list[str]:
        return [f"mlp.experts.*.{p}.{f}" for p in projs for f in fields]

    return [
        WeightConverter(source_patterns=patterns("gate_proj", "up_proj"), target_patterns="mlp.experts.gate_up_proj",
                        operations=[*head, MergeModulelist(dim=0), Concatenate(dim=1)]),
        WeightConverter(source_patterns=patterns("down_proj"), target_patterns="mlp.experts.down_proj",
                        operations=[*head, MergeModulelist(dim=0)]),
    ]


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
