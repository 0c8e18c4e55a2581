"""Generator for a tiny MiniMax-M2 stand-in from transformers' own ``MiniMaxM2*`` classes (no remote code).

Laid out as MiniMaxAI/MiniMax-M2 (and M2.5) is on the hub: ``model.layers.{i}`` with every layer MoE (no
dense or shared experts), the routed experts one Linear per expert in Mixtral's names
(``block_sparse_moe.experts.{e}.{w1,w2,w3}.weight``: w1 gate, w3 up, w2 down; transformers renames
``block_sparse_moe`` to ``mlp`` and fuses w1/w3 as it loads, ``conversion_mapping.py`` ``"minimax_m2"``),
the router ``block_sparse_moe.gate.weight`` and ``block_sparse_moe.e_score_correction_bias`` in fp32,
per-layer q/k RMSNorms over all heads (``qk_norm_type: per_layer``) and partial RoPE (``rotary_dim``).
Source format as released: block-FP8 (e4m3, 128x128 blocks, ``weight_scale_inv``) for every attention and
expert Linear; embeddings, norms and ``lm_head`` BF16 (``modules_to_not_convert: [gate,
e_score_correction_bias, lm_head]``)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..numerics.block_fp8 import block_fp8_scale_shape
from ..numerics.fp8 import fp8_quantize_blockwise
from .hub_standin import bf16_tensors, draw, hub_shapes, meta_model, per_expert
from .tiny import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, fresh_dir, write_stand_in
from .tokenizer import calibration_token_ids as calibration_token_ids

# Two MoE layers; head_dim 32 with rotary_dim 16 (the real 128 / 64: half the head rotates).
MINIMAX_M2_TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rotary_dim": 16,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}

# The released sizes, for the planner's header-only layout: MiniMaxAI/MiniMax-M2's config.json (as transformers
# 5.25's ``MiniMaxM2Config`` defaults and the model card give it): 62 layers, every one MoE with 256 experts top-8
# of intermediate 1536, hidden 3072, 48 query / 8 KV heads of 128 with rotary_dim 64, vocab 200064; about 229B
# parameters (the card's "230B total"). MiniMax-M2.5 has the same shape.
MINIMAX_M2_SIZES: dict[str, Any] = {
    "vocab_size": 200064,
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "num_hidden_layers": 62,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rotary_dim": 64,
    "num_local_experts": 256,
    "num_experts_per_tok": 8,
}

# The hub's names for transformers' fused experts (Mixtral's w1 gate, w3 up, w2 down).
_EXPERT_PROJS = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}
_FP8_LINEAR_RE = re.compile(r"\.(self_attn\.[qkvo]_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight$")
_FP32 = ("block_sparse_moe.gate.weight", "e_score_correction_bias")


def fp8_quantization_config() -> dict[str, Any]:
    """MiniMax-M2's ``quantization_config`` (hub config.json)."""
    return {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
            "weight_block_size": [128, 128], "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}


def checkpoint_config(s: dict[str, Any]) -> dict[str, Any]:
    """config.json for sizes ``s``, spelled as MiniMax-M2's."""
    return {
        "architectures": ["MiniMaxM2ForCausalLM"],
        "model_type": "minimax_m2",
        **s,
        "hidden_act": "silu",
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "shared_intermediate_size": 0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5000000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "torch_dtype": "bfloat16",
    }


def _model(config: dict[str, Any]) -> Any:
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    cfg = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "quantization_config")}
    return meta_model(MiniMaxM2ForCausalLM, MiniMaxM2Config(**cfg))


def hub_layout(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """transformers' MiniMax-M2 tensor -> the hub's tensors holding it."""
    name = name.replace(".mlp.", ".block_sparse_moe.")
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return per_expert(name, shape, _EXPERT_PROJS)
    return [(name, shape)]


def _checkpoint_tensors(shapes: list[tuple[str, tuple[int, ...]]], seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Attention and expert Linears block-FP8 (drawn, rounded to BF16, then quantized), router fp32, rest BF16."""
    for name, shape in shapes:
        if _FP8_LINEAR_RE.search(name):
            q, scale = fp8_quantize_blockwise(draw(name, shape, seed).bfloat16().float())
            yield name, q
            yield f"{name}_scale_inv", scale
        else:
            yield from bf16_tensors([(name, shape)], seed, fp32=lambda n: n.endswith(_FP32))


def _resolve_sizes(sizes: dict[str, Any]) -> dict[str, Any]:
    unknown = set(sizes) - set(MINIMAX_M2_TINY_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown tiny MiniMax-M2 setting(s) {sorted(unknown)}; known: {sorted(MINIMAX_M2_TINY_DEFAULTS)}")
    s = {**MINIMAX_M2_TINY_DEFAULTS, **sizes}
    for key in ("hidden_size", "intermediate_size", "head_dim"):
        if s[key] % 16:
            raise ValueError(f"{key}={s[key]} must be a multiple of 16 (the NVFP4 block)")
    return s


def make_tiny_minimax_m2(
    path: str | Path, *, seed: int = 0, overwrite: bool = False, max_shard_size: int | None = None, **sizes: Any
) -> Path:
    """Write a tiny block-FP8 MiniMax-M2 checkpoint into ``path`` and return it (``sizes`` override
    ``MINIMAX_M2_TINY_DEFAULTS``). Same arguments, byte-identical files."""
    s = _resolve_sizes(sizes)
    path = fresh_dir(path, overwrite)
    config = checkpoint_config(s)
    tensors = list(_checkpoint_tensors(hub_shapes(_model(config), hub_layout), seed))
    config["quantization_config"] = fp8_quantization_config()
    return write_stand_in(path, tensors, config, vocab_size=s["vocab_size"], max_shard_size=max_shard_size)


def layout_tensors(sizes: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """(config.json, [(key, dtype, shape)] in checkpoint order) at ``sizes``: the stand-in's names, each block-FP8
    Linear as its e4m3 codes and F32 ``weight_scale_inv`` (128 x 128 blocks), the router F32, the rest BF16."""
    config = checkpoint_config(_resolve_sizes(sizes))
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for name, shape in hub_shapes(_model(config), hub_layout):
        if _FP8_LINEAR_RE.search(name):
            tensors += [(name, torch.float8_e4m3fn, shape),
                        (f"{name}_scale_inv", torch.float32, block_fp8_scale_shape(shape))]
        else:
            tensors.append((name, torch.float32 if name.endswith(_FP32) else torch.bfloat16, shape))
    config["quantization_config"] = fp8_quantization_config()
    return config, tensors


def make_minimax_m2_layout(path: str | Path, *, sizes: dict[str, Any] | None = None, sparse: bool = True,
                           overwrite: bool = False, shard_bytes: int = 5 * 10**9) -> Path:
    """A full-size block-FP8 MiniMax-M2 checkpoint without the bytes (``testing/header_only.py``'s files; ``sizes``
    override ``MINIMAX_M2_SIZES``): each shard sparse (the right size, no data blocks) or, ``sparse=False``, its
    header alone; about 230 GB apparent. No tokenizer: the planners' input."""
    from .header_only import write_layout

    path = fresh_dir(path, overwrite)
    config, tensors = layout_tensors({**MINIMAX_M2_SIZES, **(sizes or {})})
    write_layout(path, config, tensors, sparse=sparse, shard_bytes=shard_bytes)
    return path
