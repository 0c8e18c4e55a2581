"""Kimi-K3 (``model_type: kimi_k3``): spec, fused experts, converters and import shims."""

from __future__ import annotations

from ..spec import ExpertProjection, ModelSpec, register_spec
from .converters import A_LOG_CONVERTER, EXPERT_KEY_RE, kimi_k3_converters
from .experts import KimiK3Experts
from .kv_cache import kv_cache_sites
from .layout import check_config_fields, dense_layout, expert_layout
from .manifest import KIMI_K3_MANIFEST
from .memory import activation_memory
from .prepare import SUPPORTED_SOURCE_FORMATS, place_experts, prepare
from .probe import probe_model
from .shims import apply_import_shims

KIMI_K3_SPEC = register_spec(
    ModelSpec(
        model_type="kimi_k3",
        # The experts interface (use_experts_implementation, grouped_mm) and WeightConverter API.
        min_transformers="5.0.0",
        build=apply_import_shims,
        prepare=prepare,
        experts_module_regex=r"\.block_sparse_moe\.experts$",
        ep_sharded_params={"gate_up_proj": 0, "down_proj": 0},
        expert_projections=(
            ExpertProjection("w1", "gate_up_proj", chunk=0, n_chunks=2),
            ExpertProjection("w3", "gate_up_proj", chunk=1, n_chunks=2),
            ExpertProjection("w2", "down_proj"),
        ),
        shared_scale_groups=(("w1", "w3"),),
        num_experts_attr="num_experts",
        expert_key_regex=EXPERT_KEY_RE.pattern,
        place_experts=place_experts,
        source_formats=SUPPORTED_SOURCE_FORMATS,
        kv_cache_sites=kv_cache_sites,
        expert_layout=expert_layout,
        dense_layout=dense_layout,
        check_config=check_config_fields,
        probe_model=probe_model,
        # KimiDecoderLayer instances of the language model (the vision tower's are encoder.blocks).
        decoder_layer_regex=r"(?:^|\.)model\.layers\.\d+$",
        # F32 in the checkpoint; rounding it to bf16 changes which experts the router selects.
        keep_source_dtype=r"\.block_sparse_moe\.gate\.e_score_correction_bias$",
        # _no_split_modules: KimiDecoderLayer (language model), MoonViTEncoderLayer (vision tower).
        fsdp_unit_key_regex=r"^(?P<unit>.+\.(?:model\.layers|encoder\.blocks)\.\d+)\.",
        activation_memory=activation_memory,
        # A_log: declared [num_heads], stored [head_dim] zero-padded in the real checkpoint.
        dense_converters=(A_LOG_CONVERTER,),
        manifest_naming=KIMI_K3_MANIFEST,
        # Text calibration never runs the vision tower or its projector (no image inputs).
        uncalibrated_module_regex=r"(^|\.)(vision_tower|mm_projector)\.",
    ),
    overwrite=True,
)

__all__ = ["KIMI_K3_SPEC", "KimiK3Experts", "kimi_k3_converters", "prepare"]
