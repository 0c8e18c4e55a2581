"""Qwen3.5-MoE (``model_type: qwen3_5_moe``: Qwen3.5-35B-A3B/-397B-A17B, Qwen3.6-35B-A3B), the VLM as released,
on transformers' own ``Qwen3_5MoeForConditionalGeneration`` (no remote code).

Built by ``models/common``'s ``transformers_moe_spec`` at the VLM's layer path (``model.language_model.layers``):
transformers' fused ``Qwen3_5MoeExperts``, the gated ``ExpertsSpec``, the meta-model source layout. What is
Qwen3.5-MoE's own (``source_layout.py``): the checkpoint stores the decoder's experts fused, which the checkpoint
view presents per expert (expert-parallel ranks read only their experts' byte ranges) and transformers' per-expert
merge fuses again; the MTP block is carried; the probe shrinks ``text_config``/``vision_config`` and the gated
delta net's widths (``probe.py``); the vision tower is never calibrated by text (``model.visual``). The gated delta
net and its short convolution run transformers' PyTorch fallbacks where ``fla``/``causal_conv1d`` are absent
(CPU), their kernels where installed. Facts: docs/decisions/0007-next-models.md, 0015-qwen3-5-moe.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightConverter

from ...spec import PrepareContext, RecipesSpec, ServingSpec, SourceCheckSpec, SpecError, register_spec
from ..common.experts import lazy_fused_experts
from ..common.layout import layer_re, meta_layouts
from ..common.lazy import lazy_attrs
from ..common.spec import transformers_moe_spec
from .memory import activation_memory
from .probe import probe_model
from .source_layout import LAYERS, LAYOUT_FIELDS, carried_modules, check_config_fields, per_expert_view

# The source check's layouts: the VLM built on meta (per-expert names, as the view presents the fused experts).
EXPERT_LAYOUT, DENSE_LAYOUT = meta_layouts("Qwen3_5MoeForConditionalGeneration", LAYOUT_FIELDS,
                                           layer_re=layer_re(LAYERS))


def prepare(ctx: PrepareContext) -> None:
    """BF16 sources only; eager experts at build on the composite config and its text config (transformers
    builds the text model from ``text_config``)."""
    text = getattr(ctx.config, "text_config", ctx.config)
    if getattr(ctx.config, "quantization_config", None) is not None or getattr(text, "quantization_config", None):
        raise SpecError("this Qwen3.5-MoE checkpoint is already quantized (config.json has a quantization_config); "
                        "the Qwen3.5-MoE spec reads BF16 checkpoints only")
    ctx.config._experts_implementation = "eager"
    text._experts_implementation = "eager"


def checkpoint_converters(ctx: PrepareContext) -> list:
    """transformers' own per-expert merge of its text model (``qwen3_5_moe_text``: per-expert ``gate_proj``/
    ``up_proj`` -> ``gate_up_proj``, ``down_proj`` -> ``down_proj``), without that mapping's prefix change: the
    VLM keeps ``model.language_model.``. The merge reads the names ``per_expert_view`` gives the fused tensors."""
    mapping = get_checkpoint_conversion_mapping("qwen3_5_moe_text") or []
    merge = [c for c in mapping if isinstance(c, WeightConverter)]
    if len(merge) != 2:
        raise SpecError(f"this transformers' qwen3_5_moe_text conversion has {len(merge)} weight converters, not "
                        "the two per-expert merges (gate/up, down) the Qwen3.5-MoE spec reads experts through")
    return merge


def serving_rules() -> Mapping[str, Any]:
    """``ServingSpec.rules``: built from ``check/``'s classes, so imported when a check first asks."""
    from .serving import SERVING

    return SERVING


def make_stand_in(path: str | Path, **sizes: Any) -> Path:
    """``ModelSpec.stand_in``: the tiny Qwen3.5-MoE VLM (``testing/qwen3_5_moe.py``)."""
    from ...testing.qwen3_5_moe import make_tiny_qwen3_5_moe

    return make_tiny_qwen3_5_moe(path, **sizes)


QWEN3_5_MOE_SPEC = register_spec(
    transformers_moe_spec(
        "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration",
        num_experts_attr="num_experts",
        layers=LAYERS,
        prepare=prepare,
        converters=checkpoint_converters,
        loading={"checkpoint_view": per_expert_view},
        quant={"probe_model": probe_model, "uncalibrated_module_regex": r"^model\.visual\."},
        activation_memory=activation_memory,
        source_check=SourceCheckSpec(expert_layout=EXPERT_LAYOUT, dense_layout=DENSE_LAYOUT,
                                     check_config=check_config_fields, carried=carried_modules),
        recipes=RecipesSpec(
            qformat={"nvfp4": "models/Qwen/Qwen3.5-MoE/nvfp4"},
            converter=None,
            no_converter_reason="its routed experts are BF16, so NVFP4 input scales need calibration",
        ),
        # Its text RMSNorms scale by 1 + weight (transformers' Qwen3_5MoeRMSNorm): the scale-plausibility bound.
        serving=ServingSpec(rules=serving_rules, norm_weight_offset=1.0),
        stand_in=make_stand_in,
    ),
)

# Made on first use: transformers' modeling module is imported when a model is built, not with the spec.
__getattr__ = lazy_attrs(__name__, {"Qwen3_5MoeFusedExperts": lazy_fused_experts("qwen3_5_moe", "Qwen3_5MoeExperts")})

__all__ = ["QWEN3_5_MOE_SPEC", "Qwen3_5MoeFusedExperts"]
