"""MiniMax-M2's calibration activations for the memory planner (transformers' ``MiniMaxM2*`` forward).

Counted from transformers 5.25's ``modeling_minimax_m2.py``: GQA attention whose ``q_norm``/``k_norm`` span all
heads of a projection (RMSNorm's fp32 copies), partial rotary (``rotary_dim``: the rotated halves and their
concatenation are full-width copies), the keys and values repeated to every query head, SDPA (equal q/v head
dims: no ``[B, H, S, S]`` scores); every layer MoE: the router's logits in the weight dtype, their fp32 sigmoid,
the biased scores and top-k. Upper-bound style, as Qwen3-MoE's (``models/qwen3_moe/memory.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

from ...memory.activations import ActivationModel

F32 = 4


def activation_memory(text: Mapping, batch: int, seq: int, dtype_bytes: int) -> ActivationModel:
    b, n = dtype_bytes, batch * seq
    d, heads, vocab = text["hidden_size"], text["num_attention_heads"], text["vocab_size"]
    head_dim = text.get("head_dim") or d // heads
    kv_heads = text.get("num_key_value_heads") or heads
    experts, inter = text["num_local_experts"], text["intermediate_size"]

    carried = 3 * n * d * b  # residual, layer input and output
    norm = n * d * 2 * F32
    qkv = n * (heads + 2 * kv_heads) * head_dim
    attention = (
        qkv * (b + 2 * F32)  # q/k/v outputs; q_norm/k_norm's fp32 copies
        + n * (heads + kv_heads) * head_dim * 3 * b  # partial rope: rotated part, pass-through part, concatenation
        + 2 * n * heads * head_dim * b  # keys and values repeated to every query head
        + n * heads * head_dim * 2 * b + n * d * b  # the attention output, its reshape, o_proj's output
    )
    phases = {"attention": norm + attention, "embedding + logits": n * vocab * b}
    # The router's logits, their fp32 sigmoid, biased scores and top-k; the routed output.
    moe_block = norm + n * experts * (b + 3 * F32) + n * d * b
    return ActivationModel(tokens=n, carried=carried, phases=phases, moe_block=moe_block,
                           expert_row_bytes=4 * inter * b, latent_dim=d, top_k=text["num_experts_per_tok"])
