"""Block-FP8 sources (``quant_method: fp8`` with ``weight_block_size [bm, bn]``), decoded as they load: shared by
every model whose hub checkpoint is released so (DeepSeek-V3/R1, Kimi-K2, MiniMax-M2).

A block-FP8 Linear stores ``weight`` float8_e4m3fn + ``weight_scale_inv`` (one fp32 scale per ``[bm, bn]``
block); the decode is ``numerics.block_fp8``. The block is the declared ``weight_block_size``, read from the
model's config when the op runs; a source without it is refused. ``fused_experts_converters`` is transformers'
per-expert stacking (``MergeModulelist`` + ``Concatenate`` of gate and up) with a decode in front, for an
experts module and projection names a package gives, so a rank decodes only its own experts' bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers.core_model_loading import Concatenate, ConversionOps, MergeModulelist, WeightConverter

from ...numerics.block_fp8 import block_fp8_decode
from ...spec import SpecError
from ...spec.conversion import DecodeOp

FP8, FP8_SCALE = "weight", "weight_scale_inv"
FP8_QUANT_METHOD = "fp8"  # quantization_config.quant_method of a block-FP8 checkpoint


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


def fused_experts_converters(experts: str, gate_up: tuple[str, str], down: str, fields: tuple[str, ...],
                             head: list[ConversionOps]) -> list[WeightConverter]:
    """Per-expert checkpoint Linears ``{experts}.{e}.{proj}.{field}`` -> ``{experts}.gate_up_proj [E, 2I, H]``
    (``gate_up``'s two halves, gate first) / ``{experts}.down_proj [E, H, I]``, each source tensor run through
    ``head`` (a decode, or nothing for a BF16 source) before transformers' stacking."""

    def patterns(*projs: str) -> list[str]:
        return [f"{experts}.*.{p}.{f}" for p in projs for f in fields]

    return [
        WeightConverter(source_patterns=patterns(*gate_up), target_patterns=f"{experts}.gate_up_proj",
                        operations=[*head, MergeModulelist(dim=0), Concatenate(dim=1)]),
        WeightConverter(source_patterns=patterns(down), target_patterns=f"{experts}.down_proj",
                        operations=[*head, MergeModulelist(dim=0)]),
    ]
