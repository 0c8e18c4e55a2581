"""DeepSeek-V3 family (``model_type: deepseek_v3``: DeepSeek-V3/R1/V3.1, Kimi-K2, Kimi-K2.5's text model):
transformers' own ``DeepseekV3*`` classes, BF16, block-FP8 or INT4 pack-quantized sources decoded as they load.

``source``: the source formats as converter chains (block-FP8 dense Linears and experts, INT4 experts).
``experts``: the fused routed experts on transformers' instances. ``prepare``: the source kind and the
experts converters. Facts: docs/DESIGN_NOTES.md "DeepSeek-V3".
"""

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
from .experts import DeepseekV3FusedExperts
from .kv_cache import kv_cache_sites, kv_scale_names
from .memory import activation_memory
from .prepare import checkpoint_converters, place_experts, prepare
from .probe import probe_model
from .source import DENSE_FP8_CONVERTERS
from .source_layout import carried_modules, check_config_fields


def serving_rules() -> Mapping[str, Any]:
    """``ServingSpec.rules``: built from ``check/``'s classes, so imported when a check first asks."""
    from .serving import SERVING

    return SERVING


def make_stand_in(path: str | Path, **sizes: Any) -> Path:
    """``ModelSpec.stand_in``: the tiny DeepSeek-V3 (``testing/deepseek_v3.py``; ``source=`` picks the format)."""
    from ...testing.deepseek_v3 import make_tiny_deepseek_v3

    return make_tiny_deepseek_v3(path, **sizes)


EXPERT_KEY_RE = r"^(?P<module>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>(?:gate|up|down)_proj)\.(?P<tensor>\w+)$"

DEEPSEEK_V3_SPEC = register_spec(
    ModelSpec(
        model_type="deepseek_v3",
        min_transformers="5.0.0",
        loading=LoadingSpec(
            model_class=TransformersClass("DeepseekV3ForCausalLM"),
            prepare=prepare,
            converters=checkpoint_converters,
            # No MXFP4 (compressed-tensors) format: the converter decodes block-FP8 and INT4 sources through
            # ``converters`` / ``dense_converters`` as the loader does (``checkpoint.source_decode.SourceDecode``).
            source_formats=frozenset(),
            dense_converters=DENSE_FP8_CONVERTERS,
        ),
        experts=ExpertsSpec(
            module_regex=r"\.mlp\.experts$",
            sharded_params={"gate_up_proj": 0, "down_proj": 0},
            projections=(
                ExpertProjection("gate_proj", "gate_up_proj", chunk=0, n_chunks=2),
                ExpertProjection("up_proj", "gate_up_proj", chunk=1, n_chunks=2),
                ExpertProjection("down_proj", "down_proj"),
            ),
            num_experts_attr="n_routed_experts",
            key_regex=EXPERT_KEY_RE,
            place_experts=place_experts,
        ),
        # vLLM/SGLang/TensorRT-LLM fuse each expert's gate/up into w13: one weight_scale_2 and input_scale.
        quant=QuantSpec(shared_scale_groups=(("gate_proj", "up_proj"),), kv_cache_sites=kv_cache_sites,
                        probe_model=probe_model),
        # _no_split_modules: DeepseekV3DecoderLayer.
        memory=MemorySpec(fsdp_unit_key_regex=r"^(?P<unit>model\.layers\.\d+)\.", activation_memory=activation_memory),
        source_check=SourceCheckSpec(check_config=check_config_fields, carried=carried_modules),
        report=ReportSpec(decoder_layer_regex=r"(?:^|\.)model\.layers\.\d+$"),
        # Without --recipe the converter writes weight-only NVFP4 where the nvfp4 recipe quantizes (W4A4 input
        # scales of BF16/FP8/INT4-sourced experts need calibration; no lossless cast into NVFP4 exists for them).
        recipes=RecipesSpec(
            qformat={"nvfp4": "models/deepseek-ai/DeepSeek-V3/nvfp4",
                     "w4a16_nvfp4": "models/deepseek-ai/DeepSeek-V3/w4a16_nvfp4"},
            converter="models/deepseek-ai/DeepSeek-V3/w4a16_nvfp4",
        ),
        # vLLM's, SGLang's and TensorRT-LLM's DeepSeek-V3 loaders (serving.py; docs "DeepSeek-V3").
        serving=ServingSpec(rules=serving_rules, kv_scale_names=kv_scale_names),
        stand_in=make_stand_in,
    ),
)

__all__ = ["DEEPSEEK_V3_SPEC", "DeepseekV3FusedExperts"]
