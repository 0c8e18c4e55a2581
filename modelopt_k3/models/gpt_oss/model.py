"""GPT-OSS on the pipeline: transformers' own classes, our experts on the instances, the checkpoint's view.

- Model class: ``FusedGptOssForCausalLM`` (``modeling.py``, imported when a model is built), a subclass of
  transformers' ``GptOssForCausalLM`` whose constructor gives each built layer's ``mlp`` a ``GptOssFusedExperts``
  (the instances only: transformers' classes stay untouched, so its own ``GptOssForCausalLM`` in the same process
  is unaffected). No checkpoint code runs (the spec's class source is ``TransformersSubclass``).
- Checkpoint view (``LoadingSpec.checkpoint_view``): the fused OpenAI MXFP4 tensors
  ``<experts>.<p>_blocks [E, out, in/32, 16]`` / ``<p>_scales [E, out, in/32]`` are shown as per-expert
  ``<experts>.<e>.<p>.weight_packed [out, in/2]`` / ``.weight_scale [out, in/32]``: the same bytes (one
  contiguous range per expert), so a rank reads exactly its experts' bytes and every per-expert stage (the
  decisions, the lossless cast, the converter's jobs, the export) works unchanged. Expert biases stay fused
  under their own names (``<experts>.<p>_bias [E, out]``) and load by this rank's rows.
- Converters (``LoadingSpec.converters``): per-expert ``weight_packed``/``weight_scale`` -> decoded, stacked ``gate_up_proj [E, 2I, H]``
  / ``down_proj [E, H, I]`` (rows as stored: gate/up interleaved).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps, MergeModulelist, WeightConverter

from ...checkpoint import CheckpointError, TensorInfo
from ...dist.placement import ExpertPlacement
from ...numerics.mxfp4 import mxfp4_decode
from ...spec import PrepareContext, SpecError
from ...spec.conversion import DecodeOp
from ..common.lazy import imported_attr
from .source_layout import BLOCK_BYTES

PACKED, SCALE = "weight_packed", "weight_scale"
PROJECTIONS = ("gate_up_proj", "down_proj")
# The stored fused MXFP4 tensors the view splits, and the per-expert keys it shows.
_FUSED_RE = re.compile(r"^(?P<module>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)_(?P<field>blocks|scales)$")
# Subclasses of transformers' GPT-OSS classes, imported when a model is built, not with the spec (common/lazy.py).
MODEL_CLASS = imported_attr(f"{__package__}.modeling", "FusedGptOssForCausalLM")
EXPERTS_CLASS = imported_attr(f"{__package__}.experts", "GptOssFusedExperts")
EXPERT_KEY_RE = re.compile(
    r"^(?P<module>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_up_proj|down_proj)\.(?P<tensor>weight_packed|weight_scale|weight)$"
)


def per_expert_view(stored: Mapping[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The checkpoint view (module docstring): fused MXFP4 blocks/scales as per-expert byte ranges.

    It cannot be fooled: a fused experts name whose tensor is not the OpenAI layout, and any stored
    per-expert tensor (a name the view derives, or could: a checkpoint stores its experts fused), is refused
    naming the stored tensor, so planted bytes never stand in for an expert's."""
    out: dict[str, TensorInfo] = {}
    derived_from: dict[str, str] = {}
    for key, info in stored.items():
        m = _FUSED_RE.match(key)
        if m is None:
            out[key] = info
            continue
        blocks = m["field"] == "blocks"
        ndim = 4 if blocks else 3
        if len(info.shape) != ndim or info.dtype != torch.uint8 or (blocks and info.shape[-1] != BLOCK_BYTES):
            need = f"uint8 [E, out, in/32, {BLOCK_BYTES}]" if blocks else "uint8 [E, out, in/32]"
            raise CheckpointError(f"stored tensor {key} is {info.dtype} {list(info.shape)}, not the OpenAI MXFP4 "
                                  f"layout of GPT-OSS experts ({need})")
        n, *rest = info.shape
        shape = (rest[0], rest[1] * rest[2]) if blocks else tuple(rest)
        per = info.nbytes // n if n else 0
        name = PACKED if blocks else SCALE
        for e in range(n):
            derived = f"{m['module']}.{e}.{m['proj']}.{name}"
            derived_from[derived] = key
            out[derived] = TensorInfo(info.file, info.dtype, shape, per, info.offset + e * per)
    fused_modules = {derived.rsplit(".", 3)[0] for derived in derived_from}
    for key in stored:
        m = EXPERT_KEY_RE.match(key)
        if m is None:
            continue
        if key in derived_from:
            raise CheckpointError(f"stored tensor {key} has the name the checkpoint view gives expert {m['expert']} "
                                  f"of stored {derived_from[key]}; a GPT-OSS checkpoint stores its experts fused, "
                                  "so this tensor is refused, never read in that expert's place")
        if m["module"] in fused_modules:
            raise CheckpointError(f"stored tensor {key} is a per-expert tensor of {m['module']}, whose experts are "
                                  "stored fused (_blocks/_scales); a checkpoint stores them one way")
    return out


class Mxfp4Decode(DecodeOp):
    """Per-expert ``(weight_packed, weight_scale)`` lists -> the stacked decoded weights, exact (FORMATS.md)."""

    codes_field, scales_field = PACKED, SCALE

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        self.dtype = dtype

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None):
        return mxfp4_decode(codes, scales, dtype, out=out)

    @torch.no_grad()
    def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                **kwargs) -> dict[str, torch.Tensor]:
        (codes_pattern,) = [p for p in source_patterns if p.endswith(PACKED)]
        scales_pattern = codes_pattern[: -len(PACKED)] + SCALE
        codes, scales = input_dict.pop(codes_pattern), input_dict.pop(scales_pattern)
        return {codes_pattern: mxfp4_decode(torch.stack(codes), torch.stack(scales), dtype=self.dtype)}

    @property
    def reverse_op(self) -> ConversionOps:
        raise NotImplementedError("modelopt_k3 exports through its own writer, never by reversing the load")


def gpt_oss_converters(*, packed: bool) -> list[WeightConverter]:
    """One converter per fused projection: per-expert tensors -> stacked ``[E, out, in]``."""
    tensors, head = ((PACKED, SCALE), [Mxfp4Decode()]) if packed else (("weight",), [])
    return [
        WeightConverter(
            source_patterns=[rf"(?<=\.)mlp\.experts\.\d+\.{proj}\.{t}" for t in tensors],
            target_patterns=f"mlp.experts.{proj}",
            operations=[*head, MergeModulelist(dim=0)],
        )
        for proj in PROJECTIONS
    ]


def prepare(ctx: PrepareContext) -> None:
    """Check the class and the checkpoint's quantization method (transformers' GPT-OSS loading is untouched)."""
    model_class = MODEL_CLASS()
    if ctx.model_cls is not model_class:
        raise SpecError(f"the GPT-OSS spec builds {model_class.__name__}, not {ctx.model_cls.__name__}")
    qcfg = getattr(ctx.config, "quantization_config", None)
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else getattr(qcfg, "quant_method", None)
    if ctx.packed_experts and str(getattr(method, "value", method)) != "mxfp4":
        raise SpecError(f"GPT-OSS experts are stored MXFP4-packed but quantization_config's quant_method is {method!r}, "
                        "not 'mxfp4'")


def checkpoint_converters(ctx: PrepareContext) -> list[WeightConverter]:
    """The spec's conversion mapping (``LoadingSpec.converters``): the experts converters for this checkpoint."""
    return gpt_oss_converters(packed=bool(ctx.packed_experts))


def place_experts(model: nn.Module, placement: ExpertPlacement) -> None:
    """Keep ``placement``'s experts in every ``GptOssFusedExperts`` of ``model`` (on the instances)."""
    experts = EXPERTS_CLASS()
    for module in model.modules():
        if isinstance(module, experts):
            module.place(placement)
