"""Checkpoint converters: per-expert ``w1/w3/w2`` -> fused ``gate_up_proj`` / ``down_proj``, and ``A_log``.

They are transformers ``WeightConverter`` objects (the library's conversion API): source patterns,
a target, and a chain of ``ConversionOps``. The chain for MXFP4-packed experts is
``Mxfp4Decompress`` (ours: exact decode of ``weight_packed`` + E8M0 ``weight_scale``) ->
``MergeModulelist`` (stack experts) -> ``Concatenate`` (gate rows first). Checkpoints whose experts
are stored plain (``.weight``) use the same chain minus the decode.

Patterns are anchored on ``.block_sparse_moe.experts.<int>.`` so ``shared_experts`` and the latent
``routed_expert_*`` projections can never match.

``A_LOG_CONVERTER`` is a dense conversion: the KDA layers declare ``A_log`` as ``[num_heads]`` while the
real checkpoint stores F32 ``[head_dim]`` with every entry past ``num_heads`` zero (kimi_k3_reference.md
section 8; the fused kernels read only ``A_log[h]``). It keeps the leading ``num_heads`` entries after
checking that the dropped ones are zero, and refuses the tensor otherwise.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from transformers.core_model_loading import Concatenate, ConversionOps, MergeModulelist, WeightConverter

from ...numerics.mxfp4 import mxfp4_decode
from ...spec.conversion import DecodeOp

EXPERTS_PREFIX = r"(?<=\.)block_sparse_moe\.experts\.\d+\."
GATE_UP_TARGET = "block_sparse_moe.experts.gate_up_proj"
DOWN_TARGET = "block_sparse_moe.experts.down_proj"
# <experts module>.<expert id>.<projection>.<tensor>, for reading ids back out of checkpoint keys.
EXPERT_KEY_RE = re.compile(r"^(?P<module>.+\.block_sparse_moe\.experts)\.(?P<expert>\d+)\.(?P<proj>w[123])\.(?P<tensor>\w+)$")
PACKED_SUFFIX, SCALE_SUFFIX = "weight_packed", "weight_scale"


def _pattern(proj: str, tensor: str) -> str:
    return rf"{EXPERTS_PREFIX}{proj}\.{tensor}"


class Mxfp4Decompress(DecodeOp):
    """``(weight_packed, weight_scale)`` lists -> decoded weights, exact (FORMATS.md MXFP4).

    The decoded, stacked ``[n_experts, out, in]`` tensor is returned under the ``weight_packed``
    pattern so that the following ``Concatenate`` keeps the source order (w1 before w3). Packed
    residency skips this step and keeps the two fields (``spec/conversion.py``).
    """

    codes_field, scales_field = PACKED_SUFFIX, SCALE_SUFFIX

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None):
        return mxfp4_decode(codes, scales, dtype, out=out)

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        self.dtype = dtype

    @torch.no_grad()
    def convert(
        self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kwargs
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for pattern in source_patterns:
            if not pattern.endswith(PACKED_SUFFIX):
                continue
            scale_pattern = pattern[: -len(PACKED_SUFFIX)] + SCALE_SUFFIX
            packed, scales = input_dict.pop(pattern), input_dict.pop(scale_pattern)
            packed = packed if isinstance(packed, list) else [packed]
            scales = scales if isinstance(scales, list) else [scales]
            if len(packed) != len(scales):
                raise ValueError(f"{len(packed)} packed tensors but {len(scales)} scales for {pattern}")
            # Decode the stacked experts at once; MergeModulelist passes a stacked tensor through, so
            # the bf16 weights are materialised once here and once more by Concatenate.
            out[pattern] = mxfp4_decode(torch.stack(packed), torch.stack(scales), dtype=self.dtype)
        return out

    @property
    def reverse_op(self) -> ConversionOps:
        raise NotImplementedError("modelopt_k3 exports through its own writer, never by reversing the load")


class DropZeroTail(ConversionOps):
    """A 1-D tensor stored longer than its parameter: keep the leading entries, refuse unless the rest are 0.

    The parameter's length comes from ``model.get_parameter(full_layer_name)`` (transformers passes both to
    every op). Returned under the target pattern.
    """

    @torch.no_grad()
    def convert(
        self,
        input_dict: dict[str, Any],
        source_patterns: list[str],
        target_patterns: list[str],
        *,
        full_layer_name: str,
        model: torch.nn.Module,
        **kwargs,
    ) -> dict[str, torch.Tensor]:
        ((_, value),) = input_dict.items()
        stored = value[0] if isinstance(value, list) else value
        length = model.get_parameter(full_layer_name).shape[0]
        if stored.ndim != 1 or stored.shape[0] < length:
            raise ValueError(
                f"{full_layer_name}: checkpoint shape {list(stored.shape)} cannot hold the model's [{length}]"
            )
        if stored[length:].any():
            bad = int(stored[length:].ne(0).nonzero()[0]) + length
            raise ValueError(
                f"{full_layer_name}: the checkpoint stores {stored.shape[0]} entries and the model reads {length}; "
                f"the dropped entries must be zero, but entry {bad} is {stored[bad].item()!r}"
            )
        return {target_patterns[0]: stored[:length]}

    @property
    def reverse_op(self) -> ConversionOps:
        raise NotImplementedError("modelopt_k3 exports unquantized tensors as the source's own bytes")


A_LOG_CONVERTER = WeightConverter(
    source_patterns=r"self_attn.A_log", target_patterns=r"self_attn.A_log", operations=[DropZeroTail()]
)


def kimi_k3_converters(*, packed: bool, dtype: torch.dtype = torch.bfloat16) -> list[WeightConverter]:
    """The two fused-expert converters for a checkpoint whose experts are ``packed`` (MXFP4) or plain."""
    if packed:
        tensors = (PACKED_SUFFIX, SCALE_SUFFIX)
        head: list[ConversionOps] = [Mxfp4Decompress(dtype)]
    else:
        tensors = ("weight",)
        head = []
    gate_up = WeightConverter(
        source_patterns=[_pattern(p, t) for p in ("w1", "w3") for t in tensors],
        target_patterns=GATE_UP_TARGET,
        operations=[*head, MergeModulelist(dim=0), Concatenate(dim=1)],
    )
    down = WeightConverter(
        source_patterns=[_pattern("w2", t) for t in tensors],
        target_patterns=DOWN_TARGET,
        operations=[*head, MergeModulelist(dim=0)],
    )
    return [gate_up, down]
