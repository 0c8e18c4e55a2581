"""GPT-OSS (``model_type: gpt_oss``): transformers' own ``GptOss*`` classes, MXFP4 routed experts.

``source_layout``: the checkpoint's OpenAI MXFP4 layout, transformers' ``GptOssExperts`` and ModelOpt's fused NVFP4
export layout, as pure functions. ``model``: the model class (our experts on transformers' instances), the
checkpoint view and converters. ``experts``: the fused experts module. The rest (layer regexes, the shared-input
probe) is ``models/common``'s builder. Facts: docs/decisions/0026-gpt-oss.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...spec import ExpertProjection, ExpertsSpec, RecipesSpec, ServingSpec, SourceCheckSpec, register_spec
from ..common.lazy import lazy_attrs
from ..common.spec import TransformersSubclass, transformers_moe_spec
from .config_layout import check_config_fields, dense_layout, expert_layout
from .memory import activation_memory
from .model import (
    EXPERT_KEY_RE,
    EXPERTS_CLASS,
    MODEL_CLASS,
    checkpoint_converters,
    per_expert_view,
    place_experts,
    prepare,
)


def serving_rules() -> Mapping[str, Any]:
    """``ServingSpec.rules``: built from ``check/``'s classes, so imported when a check first asks."""
    from .serving import SERVING

    return SERVING


def make_stand_in(path: str | Path, **sizes: Any) -> Path:
    """``ModelSpec.stand_in``: the tiny GPT-OSS (``testing/tiny_gpt_oss.py``)."""
    from ...testing.tiny_gpt_oss import make_tiny_gpt_oss

    return make_tiny_gpt_oss(path, **sizes)

GPT_OSS_SPEC = register_spec(
    transformers_moe_spec(
        "gpt_oss", "GptOssForCausalLM",
        # transformers' own classes (no checkpoint code), with our experts module on the built instances.
        model_source=TransformersSubclass(MODEL_CLASS),
        prepare=prepare,
        converters=checkpoint_converters,
        loading={"source_formats": frozenset({"mxfp4"}), "checkpoint_view": per_expert_view},
        experts_spec=ExpertsSpec(
            module_regex=r"\.mlp\.experts$",
            # The biases are sharded with their experts: a rank holds (and reads) its experts' rows only.
            sharded_params={"gate_up_proj": 0, "down_proj": 0, "gate_up_proj_bias": 0, "down_proj_bias": 0},
            # gate_up is one checkpoint projection (gate/up rows interleaved): one weight_scale_2 / input_scale.
            projections=(ExpertProjection("gate_up_proj", "gate_up_proj"), ExpertProjection("down_proj", "down_proj")),
            num_experts_attr="num_local_experts",
            key_regex=EXPERT_KEY_RE.pattern,
            place_experts=place_experts,
        ),
        activation_memory=activation_memory,
        source_check=SourceCheckSpec(expert_layout=expert_layout, dense_layout=dense_layout,
                                     check_config=check_config_fields),
        recipes=RecipesSpec(
            qformat={"nvfp4": "models/openai/gpt-oss/nvfp4"},
            converter="models/openai/gpt-oss/nvfp4_experts",
        ),
        serving=ServingSpec(rules=serving_rules),
        stand_in=make_stand_in,
    ),
)

# Made on first use: they subclass transformers' modeling classes, imported when a model is built.
__getattr__ = lazy_attrs(__name__, {"FusedGptOssForCausalLM": MODEL_CLASS, "GptOssFusedExperts": EXPERTS_CLASS})

__all__ = ["GPT_OSS_SPEC", "FusedGptOssForCausalLM", "GptOssFusedExperts"]
