"""A full-size Kimi-K2.5 checkpoint layout without the bytes (the planners' input, as ``header_only_deepseek_v3``
is DeepSeek-V3's): moonshotai/Kimi-K2.5's sizes, its storage (routed experts INT4 pack-quantized group 32, the rest
BF16, router bias F32), the hub's tensor names (the stand-in's ``hub_layout``), header-only or sparse shards.
The vision tower is transformers' ``Kimi_K25VisionConfig`` defaults, which are the released MoonViT's (27 x 1152).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .deepseek_v3 import int4_quantization_config
from .header_only import SHARD_BYTES, write_layout
from .hub_standin import hub_shapes, meta_model
from .kimi_k25 import HUB_INT4_IGNORE, _is_routed_expert, _transformers_config, checkpoint_config, hub_layout
from .tiny import fresh_dir

# moonshotai/Kimi-K2.5 text_config (docs/decisions/0007-next-models.md "Kimi-K2.5"): 61 layers (layer 0 dense),
# 384 routed experts top-8 + 1 shared, MLA, vocab 163840.
KIMI_K25_SIZES: dict[str, Any] = {
    "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "first_k_dense_replace": 1, "num_attention_heads": 64, "num_key_value_heads": 64,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
}
KIMI_K25_VISION: dict[str, Any] = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                                   "num_attention_heads": 16, "patch_size": 14, "pos_emb_height": 64,
                                   "pos_emb_width": 64}
INT4_GROUP = 32


def _int4_linear(key: str, shape: tuple[int, int]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    head, (rows, cols) = key.removesuffix(".weight"), shape
    return [(f"{head}.weight_packed", torch.int32, (rows, cols // 8)),
            (f"{head}.weight_scale", torch.bfloat16, (rows, cols // INT4_GROUP)),
            (f"{head}.weight_shape", torch.int32, (2,))]


def layout_tensors(text: dict[str, Any], vision: dict[str, Any]) -> tuple[dict, list[tuple[str, torch.dtype, tuple]]]:
    """(config.json with its INT4 ``quantization_config`` at both levels, [(key, dtype, shape)] in hub order)."""
    from transformers import Kimi_K25ForConditionalGeneration

    config = checkpoint_config(text, vision)
    shapes = hub_shapes(meta_model(Kimi_K25ForConditionalGeneration, _transformers_config(config)), hub_layout)
    config["quantization_config"] = config["text_config"]["quantization_config"] = int4_quantization_config(
        HUB_INT4_IGNORE)
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for name, shape in shapes:
        if _is_routed_expert(name):
            tensors += _int4_linear(name, shape)
        else:
            tensors.append((name, torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16,
                            shape))
    return config, tensors


def make_kimi_k25_layout(path: str | Path, *, sizes: dict[str, Any] | None = None, sparse: bool = True,
                         overwrite: bool = False, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the sparse (``sparse=False``: headers alone) INT4 Kimi-K2.5 checkpoint (``sizes`` overrides
    ``KIMI_K25_SIZES``); about 595 GB apparent, a few MB on disk. No tokenizer: the planners' input."""
    path = fresh_dir(path, overwrite)
    config, tensors = layout_tensors({**KIMI_K25_SIZES, **(sizes or {})}, KIMI_K25_VISION)
    write_layout(path, config, tensors, sparse=sparse, shard_bytes=shard_bytes)
    return path


__all__ = ["KIMI_K25_SIZES", "layout_tensors", "make_kimi_k25_layout"]
