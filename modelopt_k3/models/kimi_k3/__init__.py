"""Kimi-K3 (``model_type: kimi_k3``): spec, fused experts, converters and import shims."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...spec import (
    ExpertProjection,
    ExpertsSpec,
    ExportSpec,
    LoadingSpec,
    MemorySpec,
    ModelSpec,
    QuantSpec,
    RecipesSpec,
    RemoteCodeClass,
    ReportSpec,
    ServingSpec,
    SourceCheckSpec,
    register_spec,
)
from ..common.lazy import imported_attr, lazy_attrs
from .converters import A_LOG_CONVERTER, EXPERT_KEY_RE, kimi_k3_converters
from .kv_cache import kv_cache_sites, kv_scale_names
from .manifest import KIMI_K3_MANIFEST
from .memory import activation_memory
from .prepare import SUPPORTED_SOURCE_FORMATS, checkpoint_converters, place_experts, prepare
from .probe import probe_model
from .shims import apply_import_shims
from .source_layout import check_config_fields, dense_layout, dense_required, expert_layout


def serving_rules() -> Mapping[str, Any]:
    """``ServingSpec.rules``: built from ``check/``'s classes, so imported when a check first asks."""
    from .serving import SERVING

    return SERVING


def make_stand_in(path: str | Path, **sizes: Any) -> Path:
    """``ModelSpec.stand_in``: the tiny Kimi-K3 (``testing/tiny.py``)."""
    from ...testing.tiny import make_tiny_kimi_k3

    return make_tiny_kimi_k3(path, **sizes)


KIMI_K3_SPEC = register_spec(
    ModelSpec(
        model_type="kimi_k3",
        # The experts interface (use_experts_implementation, grouped_mm) and WeightConverter API.
        min_transformers="5.0.0",
        loading=LoadingSpec(
            # The checkpoint ships its modeling code (auto_map): loading it needs trust_remote_code.
            model_class=RemoteCodeClass(),
            prepare=prepare,
            build=apply_import_shims,
            source_formats=SUPPORTED_SOURCE_FORMATS,
            # F32 in the checkpoint; rounding it to bf16 changes which experts the router selects.
            keep_source_dtype=r"\.block_sparse_moe\.gate\.e_score_correction_bias$",
            # A_log: declared [num_heads], stored [head_dim] zero-padded in the real checkpoint.
            dense_converters=(A_LOG_CONVERTER,),
            converters=checkpoint_converters,
        ),
        experts=ExpertsSpec(
            module_regex=r"\.block_sparse_moe\.experts$",
            sharded_params={"gate_up_proj": 0, "down_proj": 0},
            projections=(
                ExpertProjection("w1", "gate_up_proj", chunk=0, n_chunks=2),
                ExpertProjection("w3", "gate_up_proj", chunk=1, n_chunks=2),
                ExpertProjection("w2", "down_proj"),
            ),
            num_experts_attr="num_experts",
            key_regex=EXPERT_KEY_RE.pattern,
            place_experts=place_experts,
        ),
        quant=QuantSpec(
            shared_scale_groups=(("w1", "w3"),),
            kv_cache_sites=kv_cache_sites,
            probe_model=probe_model,
            # Text calibration never runs the vision tower or its projector (no image inputs).
            uncalibrated_module_regex=r"(^|\.)(vision_tower|mm_projector)\.",
        ),
        export=ExportSpec(manifest_naming=KIMI_K3_MANIFEST),
        memory=MemorySpec(
            # _no_split_modules: KimiDecoderLayer (language model), MoonViTEncoderLayer (vision tower).
            fsdp_unit_key_regex=r"^(?P<unit>.+\.(?:model\.layers|encoder\.blocks)\.\d+)\.",
            activation_memory=activation_memory,
        ),
        source_check=SourceCheckSpec(expert_layout=expert_layout, dense_layout=dense_layout,
                                     dense_required=dense_required, dense_exact=True,
                                     check_config=check_config_fields),
        # KimiDecoderLayer instances of the language model (the vision tower's are encoder.blocks).
        report=ReportSpec(decoder_layer_regex=r"(?:^|\.)model\.layers\.\d+$"),
        recipes=RecipesSpec(converter="models/moonshotai/Kimi-K3/nvfp4_experts"),
        serving=ServingSpec(rules=serving_rules, kv_scale_names=kv_scale_names),
        stand_in=make_stand_in,
    ),
)



# ``KimiK3Experts`` on first use (prepare.make_fused_block says why it is not imported with the spec).
__getattr__ = lazy_attrs(__name__, {"KimiK3Experts": imported_attr(f"{__name__}.experts", "KimiK3Experts")})


__all__ = ["KIMI_K3_SPEC", "KimiK3Experts", "kimi_k3_converters", "prepare"]
