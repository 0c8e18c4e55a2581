"""Kimi-K3's calibration activations for the memory planner (kimi_k3_reference.md sections 2-3).

Counted from the remote code's forward as this project runs it (the stand-in and the vendored code
use eager MLA attention, fp32 softmax; the KDA kernels and SituAndMul compute in fp32). Sizes are the
tensors alive at each phase's peak; an upper-bound style estimate, not an allocator trace.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ...memory.activations import ActivationModel

F32 = 4


def _mlp_bytes(tokens: int, width: int, b: int) -> int:
    """A SituAndMul MLP of intermediate ``width``: [gate || up] in the weight dtype, its fp32 copy and
    the activation's fp32 temporaries (tanh, sigmoid, product), the result cast back."""
    return tokens * (2 * width * b + 2 * width * F32 + 3 * width * F32 + width * b)


def activation_memory(text: Mapping, batch: int, seq: int, dtype_bytes: int) -> ActivationModel:
    b = dtype_bytes
    n = batch * seq
    d = text["hidden_size"]
    layers = text["num_hidden_layers"]
    heads = text["num_attention_heads"]
    dq = text["qk_nope_head_dim"] + text["qk_rope_head_dim"]
    v_dim = text["v_head_dim"]
    lin = text.get("linear_attn_config") or {}
    kda_layers = set(lin.get("kda_layers") or ())
    proj = (lin.get("num_heads") or 0) * (lin.get("head_dim") or 0)
    block = text.get("attn_res_block_size")
    blocks = math.ceil(layers / block) if block else 0
    latent = text.get("routed_expert_hidden_size") or d
    inter = text["moe_intermediate_size"]
    shared = inter * (text.get("num_shared_experts") or 0)

    # Residual stream, the layer's input and output, and AttnRes' block list [N, blocks, D] at its largest.
    carried = n * d * b * (3 + blocks)
    phases = {
        # scores q.k^T in fp32, + mask (a new fp32 tensor), softmax (fp32), probs cast back; the mask
        # [B, 1, S, S] fp32; q/k/v [B, H, S, dq|v] in the weight dtype.
        "MLA attention (eager, fp32 scores)": batch * heads * seq * seq * (3 * F32 + b)
        + batch * seq * seq * F32 + n * heads * (2 * dq + 2 * v_dim) * b,
        "embedding + logits": n * text["vocab_size"] * b,
    }
    if kda_layers:
        # q/k/v/g projections, their fp32 conv/gate copies and the kernel's fp32 working set.
        phases["KDA attention"] = n * proj * (4 * b + 6 * F32)
    if blocks:
        # AttnRes mix over [R_1..R_n, p]: the concatenation, its fp32 copy, the normalised copy, the product.
        phases["attention-residual mix"] = n * (blocks + 1) * d * (b + 3 * F32)
    if text.get("first_k_dense_replace", 0) > 0:
        phases["dense MLP"] = _mlp_bytes(n, text["intermediate_size"], b)
    # Router fp32 scores/choice [N, E], the latent input and the routed output [N, Dl], the shared
    # experts' MLP (it runs after the routed experts, whose output stays alive).
    moe_block = n * text["num_experts"] * 3 * F32 + 2 * n * latent * b + _mlp_bytes(n, shared, b)
    expert_row = 2 * inter * b + 2 * inter * F32 + 3 * inter * F32 + inter * b
    return ActivationModel(
        tokens=n, carried=carried, phases=phases, moe_block=moe_block, expert_row_bytes=expert_row,
        latent_dim=latent, top_k=text["num_experts_per_token"],
    )
