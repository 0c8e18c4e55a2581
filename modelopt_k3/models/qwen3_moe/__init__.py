"""Qwen3-MoE (``model_type: qwen3_moe``, transformers' own ``Qwen3Moe*`` classes, BF16 experts): the spec."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...spec import (
    ExpertProjection,
    ExpertsSpec,
    LoadingSpec,
    MemorySpec,
    ModelSpec,
    QuantSpec,
    RecipesSpec,
    ReportSpec,
    ServingSpec,
    SourceCheckSpec,
    TransformersClass,
    register_spec,
)
from .experts import Qwen3MoeFusedExperts
from .memory import activation_memory
from .prepare import checkpoint_converters, place_experts, prepare
from .probe import probe_model
from .source_layout import check_config_fields, dense_layout, expert_layout


def serving_rules() -> Mapping[str, Any]:
    """``ServingSpec.rules``: built from ``check/``'s classes, so imported when a check first asks."""
    from .serving import SERVING

    return SERVING


def make_stand_in(path: str | Path, **sizes: Any) -> Path:
    """``ModelSpec.stand_in``: the tiny Qwen3-MoE (``testing/qwen3_moe.py``)."""
    from ...testing.qwen3_moe import make_tiny_qwen3_moe

    return make_tiny_qwen3_moe(path, **sizes)

EXPERT_KEY_RE = r"^(?P<module>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>(?:gate|up|down)_proj)\.(?P<tensor>\w+)$"

QWEN3_MOE_SPEC = register_spec(
    ModelSpec(
        model_type="qwen3_moe",
        # Fused Qwen3MoeExperts behind the experts interface, and the qwen2_moe checkpoint conversion.
        min_transformers="5.0.0",
        loading=LoadingSpec(model_class=TransformersClass("Qwen3MoeForCausalLM"), prepare=prepare,
                            converters=checkpoint_converters),
        experts=ExpertsSpec(
            module_regex=r"\.mlp\.experts$",
            sharded_params={"gate_up_proj": 0, "down_proj": 0},
            projections=(
                ExpertProjection("gate_proj", "gate_up_proj", chunk=0, n_chunks=2),
                ExpertProjection("up_proj", "gate_up_proj", chunk=1, n_chunks=2),
                ExpertProjection("down_proj", "down_proj"),
            ),
            num_experts_attr="num_experts",
            key_regex=EXPERT_KEY_RE,
            place_experts=place_experts,
        ),
        # Both engines fuse gate/up into w13 with one weight_scale_2 and one input_scale (serving.py).
        quant=QuantSpec(shared_scale_groups=(("gate_proj", "up_proj"),), probe_model=probe_model),
        # _no_split_modules: Qwen3MoeDecoderLayer.
        memory=MemorySpec(fsdp_unit_key_regex=r"^(?P<unit>model\.layers\.\d+)\.", activation_memory=activation_memory),
        source_check=SourceCheckSpec(expert_layout=expert_layout, dense_layout=dense_layout,
                                     check_config=check_config_fields),
        report=ReportSpec(decoder_layer_regex=r"(?:^|\.)model\.layers\.\d+$"),
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

__all__ = ["QWEN3_MOE_SPEC", "Qwen3MoeFusedExperts"]
