"""A full-size DeepSeek-V3/R1 checkpoint layout without the bytes (the planners' input, as ``header_only`` is
Kimi-K3's): the hub config's sizes, the block-FP8 storage, real tensor names/shapes/dtypes, header-only shards.

Names and shapes come from transformers' own ``DeepseekV3ForCausalLM`` built on the meta device (its experts
are fused parameters, so 256 experts cost nothing to build), written back one Linear per expert as the hub
stores them; dtypes follow the tiny generator's rules (``testing/deepseek_v3.py``: every decoder Linear
float8_e4m3fn with an F32 ``weight_scale_inv`` per 128 x 128 block, the router's bias F32, the rest BF16).
The MTP layer of the hub checkpoint (layer 61, about 1.7% of the bytes) is left out: no pipeline here reads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .deepseek_v3 import _EXPERT_RE, _LINEAR_RE, _meta_model, _persistent, _resolve_sizes, checkpoint_config
from .deepseek_v3 import fp8_quantization_config as fp8_quantization_config
from .header_only import SHARD_BYTES, write_layout
from .tiny import fresh_dir

# deepseek-ai/DeepSeek-V3 (and -R1, the same architecture) config.json: 671B parameters, 61 layers (3 dense),
# 256 routed experts of moe_intermediate 2048, top-8, one shared expert, MLA.
DEEPSEEK_V3_SIZES: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
FP8_BLOCK = 128


def _fp8_linear(key: str, shape: tuple[int, int]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    head = key.removesuffix(".weight")
    scales = (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))
    return [(key, torch.float8_e4m3fn, shape), (f"{head}.weight_scale_inv", torch.float32, scales)]


def layout_tensors(sizes: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """(config.json with its FP8 ``quantization_config``, [(key, dtype, shape)] in checkpoint order)."""
    config = checkpoint_config(_resolve_sizes(sizes))
    model = _meta_model(config)
    config["quantization_config"] = fp8_quantization_config()
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for name, param in _persistent(model):
        shape = tuple(param.shape)
        m = _EXPERT_RE.match(name)
        if m is not None:
            num_experts, rows, cols = shape
            projs = ("gate_proj", "up_proj") if m["param"] == "gate_up_proj" else ("down_proj",)
            for e in range(num_experts):
                for proj in projs:
                    tensors += _fp8_linear(f"{m['prefix']}.{e}.{proj}.weight", (rows // len(projs), cols))
        elif _LINEAR_RE.search(name):
            tensors += _fp8_linear(name, shape)
        else:
            tensors.append((name, torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16,
                            shape))
    return config, tensors


def make_deepseek_v3_layout(path: str | Path, *, sizes: dict[str, Any] | None = None, sparse: bool = True,
                            overwrite: bool = False, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the sparse (every tensor reads as zeros; ``sparse=False``: headers alone) block-FP8 DeepSeek-V3
    checkpoint (``sizes`` overrides ``DEEPSEEK_V3_SIZES``); about 690 GB apparent, a few MB on disk. No tokenizer:
    it is the planners' input (``modelopt-k3-plan``), not a run's."""
    path = fresh_dir(path, overwrite)
    config, tensors = layout_tensors({**DEEPSEEK_V3_SIZES, **(sizes or {})})
    write_layout(path, config, tensors, sparse=sparse, shard_bytes=shard_bytes)
    return path


__all__ = ["DEEPSEEK_V3_SIZES", "layout_tensors", "make_deepseek_v3_layout"]
