"""Prepare transformers' own Qwen3-MoE classes for our loader; place the experts on the built instances.

Nothing of transformers is edited. The spec's conversion mapping (``checkpoint_converters``) is the one
transformers itself applies to ``qwen3_moe`` (its ``qwen2_moe`` mapping: per-expert ``gate_proj``/``up_proj``
-> ``gate_up_proj`` by ``MergeModulelist`` + ``Concatenate``, ``down_proj`` by ``MergeModulelist``), so our
loader runs the very same chain on this rank's experts only.
``place_experts`` narrows each built ``Qwen3MoeExperts`` to the placement's block and re-classes that
instance (``experts.place``).
"""

from __future__ import annotations

from torch import nn
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from ...dist.placement import ExpertPlacement
from ...spec import PrepareContext, SpecError
from .experts import place

MODEL_TYPE = "qwen3_moe"


def converters() -> list:
    """transformers' own weight conversions for ``qwen3_moe`` (a fresh copy)."""
    mapping = get_checkpoint_conversion_mapping(MODEL_TYPE)
    if not mapping:
        raise SpecError(f"this transformers has no checkpoint conversion for {MODEL_TYPE!r} (fused experts need >= 5.0)")
    return mapping


def checkpoint_converters(ctx: PrepareContext) -> list:
    """The spec's conversion mapping (``LoadingSpec.converters``): transformers' own, for any checkpoint."""
    return converters()


def prepare(ctx: PrepareContext) -> None:
    if getattr(ctx.config, "quantization_config", None) is not None:
        raise SpecError("this Qwen3-MoE checkpoint is already quantized (config.json has a quantization_config); "
                        "the Qwen3-MoE spec reads BF16 checkpoints only")
    # Construct with eager; the loader installs the plan's implementation on the built model.
    ctx.config._experts_implementation = "eager"


def place_experts(model: nn.Module, placement: ExpertPlacement) -> None:
    """Keep ``placement``'s experts in every ``Qwen3MoeExperts`` of ``model`` (``ModelSpec.place_experts``)."""
    for module in model.modules():
        if isinstance(module, Qwen3MoeExperts):
            place(module, placement)
