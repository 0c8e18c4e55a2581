"""A full-size Nemotron-3 Super (120B-A12B) checkpoint layout without the bytes: the planners' input, as
``header_only_deepseek_v3`` is DeepSeek-V3's.

Sizes from the release's config.json as third-party config checks quote it (docs/decisions/0007-next-models.md):
88 layers, 40 Mamba-2 (``M``), 40 latent MoE (``E``), 8 attention (``*``); hidden 4096, 512 routed experts top-22
(intermediate 2688, latent 1024), shared expert 5376, one MTP block ``*E``. The order of the 88 layer kinds was not
found: ``SUPER_PATTERN`` has the release's counts (what the planner reads: per-kind tensors, MoE layers), not its
order. Names and shapes come from the tiny generator's rules (``testing/nemotron_h.py``: transformers' classes
built on meta, written as the hub stores them, MTP included), BF16 but the routers' fp32 score-correction bias.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .header_only import SHARD_BYTES, write_layout
from .hub_standin import hub_shapes
from .nemotron_h import NEMOTRON_H_TINY_DEFAULTS, _model, checkpoint_config, hub_layout, mtp_shapes
from .tiny import fresh_dir

SUPER_PATTERN = "MEMEM*EMEME" * 8  # 40 M, 40 E, 8 * (the release's counts; its order not known here)
NEMOTRON_3_SUPER_SIZES: dict[str, Any] = {
    "vocab_size": 131072,
    "hidden_size": 4096,
    "hybrid_override_pattern": SUPER_PATTERN,
    "mtp_hybrid_override_pattern": "*E",
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "chunk_size": 128,
    "n_routed_experts": 512,
    "num_experts_per_tok": 22,
    "moe_intermediate_size": 2688,
    "moe_shared_expert_intermediate_size": 5376,
    "moe_latent_size": 1024,
}


def layout_tensors(sizes: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """(config.json, [(key, dtype, shape)] in checkpoint order) for ``sizes`` (keys of the tiny defaults)."""
    unknown = set(sizes) - set(NEMOTRON_H_TINY_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown Nemotron-H size(s) {sorted(unknown)}")
    config = checkpoint_config({**NEMOTRON_H_TINY_DEFAULTS, **sizes})
    shapes = hub_shapes(_model(config, config["hybrid_override_pattern"]), hub_layout)
    if config["num_nextn_predict_layers"]:
        shapes += mtp_shapes(config)
    return config, [(name, torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16, shape)
                    for name, shape in shapes]


def make_nemotron_3_super_layout(path: str | Path, *, sizes: dict[str, Any] | None = None, sparse: bool = True,
                                 overwrite: bool = False, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the sparse (``sparse=False``: headers alone) BF16 Nemotron-3 Super checkpoint (``sizes`` overrides
    ``NEMOTRON_3_SUPER_SIZES``); about 240 GB apparent, a few MB on disk. No tokenizer: a planner's input."""
    path = fresh_dir(path, overwrite)
    config, tensors = layout_tensors({**NEMOTRON_3_SUPER_SIZES, **(sizes or {})})
    write_layout(path, config, tensors, sparse=sparse, shard_bytes=shard_bytes)
    return path


__all__ = ["NEMOTRON_3_SUPER_SIZES", "SUPER_PATTERN", "layout_tensors", "make_nemotron_3_super_layout"]
