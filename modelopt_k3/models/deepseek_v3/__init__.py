"""DeepSeek-V3 family (``model_type: deepseek_v3``: DeepSeek-V3/R1/V3.1, Kimi-K2, Kimi-K2.5's text model):
transformers' own ``DeepseekV3*`` classes, BF16, block-FP8 or INT4 pack-quantized sources decoded as they load.

Built by ``models/common``'s ``transformers_moe_spec`` (fused ``DeepseekV3Experts``, the gate/up layout, the
layer regexes) and its MLA KV-cache site. What is DeepSeek-V3's own: ``prepare`` (the source kind and its
experts converters), recipes, serving rules and memory model. Facts: docs/decisions/0027-deepseek-v3.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...spec import RecipesSpec, ServingSpec, SourceCheckSpec, register_spec
from ..common.compressed_sources import DENSE_FP8_CONVERTERS
from ..common.experts import lazy_fused_experts
from ..common.lazy import lazy_attrs
from ..common.mla_memory import activation_memory
from ..common.spec import transformers_moe_spec
from .kv_cache import kv_cache_sites, kv_scale_names
from .prepare import checkpoint_converters, prepare
from .source_layout import carried_modules, check_config_fields


def serving_rules() -> Mapping[str, Any]:
    """``ServingSpec.rules``: built from ``check/``'s classes, so imported when a check first asks."""
    from .serving import SERVING

    return SERVING


def make_stand_in(path: str | Path, **sizes: Any) -> Path:
    """``ModelSpec.stand_in``: the tiny DeepSeek-V3 (``testing/deepseek_v3.py``; ``source=`` picks the format)."""
    from ...testing.deepseek_v3 import make_tiny_deepseek_v3

    return make_tiny_deepseek_v3(path, **sizes)


DEEPSEEK_V3_SPEC = register_spec(
    transformers_moe_spec(
        "deepseek_v3", "DeepseekV3ForCausalLM",
        num_experts_attr="n_routed_experts",
        prepare=prepare,
        converters=checkpoint_converters,
        # No MXFP4 (compressed-tensors) format: the converter decodes block-FP8 and INT4 sources through
        # ``converters`` / ``dense_converters`` as the loader does (``checkpoint.source_decode.SourceDecode``).
        loading={"source_formats": frozenset(), "dense_converters": DENSE_FP8_CONVERTERS},
        quant={"kv_cache_sites": kv_cache_sites},
        activation_memory=activation_memory,
        source_check=SourceCheckSpec(check_config=check_config_fields, carried=carried_modules),
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

# Made on first use: transformers' modeling module is imported when a model is built, not with the spec.
__getattr__ = lazy_attrs(__name__, {"DeepseekV3FusedExperts": lazy_fused_experts("deepseek_v3", "DeepseekV3Experts")})

__all__ = ["DEEPSEEK_V3_SPEC", "DeepseekV3FusedExperts"]
