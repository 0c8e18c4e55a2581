"""GPT-OSS (``model_type: gpt_oss``): transformers' own ``GptOss*`` classes, MXFP4 routed experts.

``layout``: the checkpoint's OpenAI MXFP4 layout, transformers' ``GptOssExperts`` and ModelOpt's fused NVFP4
export layout, as pure functions. ``model``: the model class (our experts on transformers' instances), the
checkpoint view and converters. ``experts``: the fused experts module.
"""

from __future__ import annotations

from ...checkpoint import register_checkpoint_view
from ..spec import ExpertProjection, ModelSpec, register_spec
from .config_layout import check_config_fields, dense_layout, expert_layout
from .experts import GptOssFusedExperts
from .model import (
    EXPERT_KEY_RE,
    FusedGptOssForCausalLM,
    TransformersGptOss,
    per_expert_view,
    place_experts,
    prepare,
)

register_checkpoint_view("gpt_oss", per_expert_view)

GPT_OSS_SPEC = register_spec(
    ModelSpec(
        model_type="gpt_oss",
        min_transformers="5.0.0",
        build=lambda path: None,  # transformers' own classes: nothing to shim
        prepare=prepare,
        experts_module_regex=r"\.mlp\.experts$",
        # Biases are sharded with their experts (EP keeps an expert's bias on the rank that holds it).
        ep_sharded_params={"gate_up_proj": 0, "down_proj": 0, "gate_up_proj_bias": 0, "down_proj_bias": 0},
        # gate_up is one checkpoint projection (gate/up rows interleaved): one weight_scale_2 and input_scale.
        expert_projections=(ExpertProjection("gate_up_proj", "gate_up_proj"), ExpertProjection("down_proj", "down_proj")),
        shared_scale_groups=(),
        num_experts_attr="num_local_experts",
        expert_key_regex=EXPERT_KEY_RE.pattern,
        place_experts=place_experts,
        source_formats=frozenset({"mxfp4"}),
        expert_layout=expert_layout,
        dense_layout=dense_layout,
        check_config=check_config_fields,
        decoder_layer_regex=r"(?:^|\.)model\.layers\.\d+$",
        fsdp_unit_key_regex=r"^(?P<unit>model\.layers\.\d+)\.",
        model_class=TransformersGptOss(),
        router_regex=r"\.mlp\.router$",
    ),
    overwrite=True,
)

__all__ = ["GPT_OSS_SPEC", "FusedGptOssForCausalLM", "GptOssFusedExperts", "TransformersGptOss"]
