"""Qwen3-MoE's calibration activations for the memory planner (transformers' ``Qwen3Moe*`` forward).

Counted from transformers 5.24's ``modeling_qwen3_moe.py``: GQA attention with per-head ``q_norm``/``k_norm``
(RMSNorm's fp32 copies), the keys and values repeated to every query head, attention through SDPA (the
loader's default; equal query/value head dims let its fused kernels run: no ``[B, H, S, S]`` scores and, without
padding, no mask), the router's logits in the weight dtype and their fp32 softmax, ``mlp_only_layers``' dense
SiLU MLP. Upper-bound style, measured against
the stand-in's own forward by ``tests/memory/test_activation_models.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...memory.activations import ActivationModel, gated_mlp_bytes

F32 = 4


def activation_memory(text: Mapping, batch: int, seq: int, dtype_bytes: int) -> ActivationModel:
    b, n = dtype_bytes, batch * seq
    d, heads, vocab = text["hidden_size"], text["num_attention_heads"], text["vocab_size"]
    head_dim = text.get("head_dim") or d // heads
    kv_heads = text.get("num_key_value_heads") or heads
    experts, inter = text["num_experts"], text["moe_intermediate_size"]

    carried = 3 * n * d * b  # residual, layer input and output
    norm = n * d * 2 * F32
    attention = (
        n * (heads + 2 * kv_heads) * head_dim * (b + 2 * F32)  # q/k/v outputs; q_norm/k_norm's fp32 copies
        + n * (heads + kv_heads) * head_dim * 2 * b  # the rotated queries and keys
        + 2 * n * heads * head_dim * b  # keys and values repeated to every query head
        + n * heads * head_dim * 2 * b + n * d * b  # the attention output, its reshape, o_proj's output
    )
    phases = {"attention": norm + attention, "embedding + logits": n * vocab * b}
    if text.get("mlp_only_layers") or (text.get("decoder_sparse_step") or 1) > 1:
        phases["dense MLP"] = norm + gated_mlp_bytes(n, text["intermediate_size"], b) + n * d * b
    # The router's logits, their fp32 softmax and top-k values; the routed output.
    moe_block = norm + n * experts * (b + 2 * F32) + n * d * b
    return ActivationModel(tokens=n, carried=carried, phases=phases, moe_block=moe_block,
                           expert_row_bytes=4 * inter * b, latent_dim=d, top_k=text["num_experts_per_tok"])
