"""Kimi-K2.5 (``model_type: kimi_k25``, moonshotai/Kimi-K2.5 and K2.6): a DeepSeek-V3 text model with INT4
pack-quantized routed experts, a MoonViT vision tower and its projector.

Built by ``models/common``'s ``transformers_moe_spec`` on transformers' own ``DeepseekV3*`` classes, held as
``language_model`` of our ``KimiK25TextForCausalLM`` so each text module's name is its hub name (``model.py``);
the INT4 experts decode as they load (``common/compressed_sources.py``, DeepSeek-V3's chain); the vision tower
and projector are carried as stored (``vision.py``). What is Kimi-K2.5's own: that wrapper, the carried vision
part, the recipe, the serving rules and the ``language_model.`` prefix of the KV-cache scales and the probe.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...spec import RecipesSpec, ServingSpec, SourceCheckSpec, register_spec
from ..common.deepseek_text import check_config_fields
from ..common.lazy import modeling_class
from ..common.mla_memory import activation_memory
from ..common.spec import TransformersSubclass, transformers_moe_spec
from .kv_cache import kv_cache_sites, kv_scale_names
from .model import MODEL_CLASS, checkpoint_converters, prepare, probe_model
from .vision import carried_modules


def check_config(config: Mapping[str, Any]) -> None:
    """``SourceCheckSpec.check_config``: the DeepSeek-V3 fields of ``text_config`` (where the tools read them)."""
    from ...spec import SpecError

    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise SpecError("a kimi_k25 config.json needs a text_config object (the DeepSeek-V3 text model)")
    check_config_fields(text)
    if text.get("num_nextn_predict_layers"):
        raise SpecError(f"text_config.num_nextn_predict_layers = {text['num_nextn_predict_layers']!r}; Kimi-K2.5 "
                        "has no MTP layers and this spec carries none")


def serving_rules() -> Mapping[str, Any]:
    """``ServingSpec.rules``: built from ``check/``'s classes, so imported when a check first asks."""
    from .serving import SERVING

    return SERVING


def make_stand_in(path: str | Path, **sizes: Any) -> Path:
    """``ModelSpec.stand_in``: the tiny Kimi-K2.5 (``testing/kimi_k25.py``: hub layout, INT4 experts, MoonViT)."""
    from ...testing.kimi_k25 import make_tiny_kimi_k25

    return make_tiny_kimi_k25(path, **sizes)


KIMI_K25_SPEC = register_spec(
    transformers_moe_spec(
        "kimi_k25", "Kimi_K25ForConditionalGeneration",
        num_experts_attr="n_routed_experts",
        experts=modeling_class("deepseek_v3", "DeepseekV3Experts"),
        model_source=TransformersSubclass(MODEL_CLASS),
        prepare=prepare,
        converters=checkpoint_converters,
        layers="language_model.model.layers",
        quant={"kv_cache_sites": kv_cache_sites, "probe_model": probe_model,
               # Text calibration never runs the vision tower or projector (not built: carried as stored).
               "uncalibrated_module_regex": r"(^|\.)(vision_tower|mm_projector)\."},
        activation_memory=activation_memory,
        source_check=SourceCheckSpec(check_config=check_config, carried=carried_modules),
        recipes=RecipesSpec(
            qformat={"nvfp4": "models/moonshotai/Kimi-K2.5/nvfp4"},
            converter=None,
            no_converter_reason="its routed experts are INT4, so NVFP4 input scales need calibration",
        ),
        serving=ServingSpec(rules=serving_rules, kv_scale_names=kv_scale_names),
        stand_in=make_stand_in,
    ),
)

__all__ = ["KIMI_K25_SPEC"]
