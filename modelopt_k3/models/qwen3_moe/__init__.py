"""Qwen3-MoE (``model_type: qwen3_moe``, transformers' own ``Qwen3Moe*`` classes, BF16 experts): the spec.

Built by ``models/common``'s ``transformers_moe_spec``: transformers' fused ``Qwen3MoeExperts`` behind its
experts interface and its own checkpoint conversion (the ``qwen2_moe`` mapping: per-expert
``gate_proj``/``up_proj`` -> ``gate_up_proj`` by ``MergeModulelist`` + ``Concatenate``). What is Qwen3-MoE's
own: BF16 sources only, its recipes, serving rules, config checks and memory model.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...spec import PrepareContext, RecipesSpec, ServingSpec, SpecError, register_spec
from ..common.experts import lazy_fused_experts
from ..common.lazy import lazy_attrs
from ..common.spec import eager_experts, transformers_moe_spec
from .memory import activation_memory
from .source_layout import LAYOUT_FIELDS, check_config_fields


def prepare(ctx: PrepareContext) -> None:
    if getattr(ctx.config, "quantization_config", None) is not None:
        raise SpecError("this Qwen3-MoE checkpoint is already quantized (config.json has a quantization_config); "
                        "the Qwen3-MoE spec reads BF16 checkpoints only")
    eager_experts(ctx)


def serving_rules() -> Mapping[str, Any]:
    """``ServingSpec.rules``: built from ``check/``'s classes, so imported when a check first asks."""
    from .serving import SERVING

    return SERVING


def make_stand_in(path: str | Path, **sizes: Any) -> Path:
    """``ModelSpec.stand_in``: the tiny Qwen3-MoE (``testing/qwen3_moe.py``)."""
    from ...testing.qwen3_moe import make_tiny_qwen3_moe

    return make_tiny_qwen3_moe(path, **sizes)


QWEN3_MOE_SPEC = register_spec(
    transformers_moe_spec(
        "qwen3_moe", "Qwen3MoeForCausalLM",
        num_experts_attr="num_experts",
        prepare=prepare,
        activation_memory=activation_memory,
        check_config=check_config_fields,
        layout_fields=LAYOUT_FIELDS,
        recipes=RecipesSpec(
            # presets/nvfp4 keeps attention BF16 for Kimi-K3's engines; Qwen3-MoE's serve it NVFP4 (serving.py).
            qformat={"nvfp4": "presets/nvfp4_default"},
            converter=None,
            no_converter_reason="its routed experts are BF16, so NVFP4 input scales need calibration",
        ),
        serving=ServingSpec(rules=serving_rules),
        stand_in=make_stand_in,
    ),
)

# Made on first use: transformers' modeling module is imported when a model is built, not with the spec.
__getattr__ = lazy_attrs(__name__, {"Qwen3MoeFusedExperts": lazy_fused_experts("qwen3_moe", "Qwen3MoeExperts")})

__all__ = ["QWEN3_MOE_SPEC", "Qwen3MoeFusedExperts"]
