"""The calibration activations of the DeepSeek-V3 text model (DeepSeek-V3, Kimi-K2.5's text model) for the memory
planner (transformers' ``DeepseekV3*`` forward; shared: no model package imports another).

Counted from transformers 5.24's ``modeling_deepseek_v3.py`` as this project runs it: MLA attention with the
latent ``kv_b_proj`` expansion (``expand_kv``), the attention interface over ``[B, H, S, S]`` scores (counted
as eager's: the scores, their fp32 softmax and the cast back; SDPA's fused kernels stay below that), RMSNorm's
fp32 copies, the router's fp32 copy of the hidden states and its ``[N, E]`` fp32 score tensors, the shared
experts' SiLU MLP. Sizes are the tensors alive at each phase's peak; an upper-bound style estimate, measured
against the stand-in's own forward by ``tests/memory/test_activation_models.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...memory.activations import ActivationModel, gated_mlp_bytes, scores_bytes

F32 = 4


def activation_memory(text: Mapping, batch: int, seq: int, dtype_bytes: int) -> ActivationModel:
    b, n = dtype_bytes, batch * seq
    d, heads, vocab = text["hidden_size"], text["num_attention_heads"], text["vocab_size"]
    nope, rope, dv = text["qk_nope_head_dim"], text["qk_rope_head_dim"], text["v_head_dim"]
    dq, q_lora, kv_lora = nope + rope, text.get("q_lora_rank") or 0, text["kv_lora_rank"]
    experts, inter = text["n_routed_experts"], text["moe_intermediate_size"]
    shared = inter * (text.get("n_shared_experts") or 0)

    # The residual stream, the layer's input and output, the causal mask [B, 1, S, S].
    carried = 3 * n * d * b + batch * seq * seq * b
    norm = n * d * 2 * F32  # RMSNorm: the fp32 copy and its normalised product
    mla = (
        n * q_lora * (b + 2 * F32)  # q_a_proj output and q_a_layernorm's fp32 copies
        + n * heads * dq * 3 * b  # q_b_proj output, the rotated q part, the concatenated query
        + n * (kv_lora + rope) * (b + 2 * F32)  # kv_a_proj_with_mqa output, kv_a_layernorm's fp32 copies
        + n * heads * ((nope + dv) + dq + dv) * b  # kv_b_proj output, the expanded keys and values
        + scores_bytes(batch, heads, seq, b)
        + n * heads * dv * 2 * b  # the attention output and its contiguous reshape
        + n * d * b  # o_proj output
    )
    phases = {"MLA attention": norm + mla, "embedding + logits": n * vocab * b}
    if (text.get("first_k_dense_replace") or 0) > 0:
        phases["dense MLP"] = norm + gated_mlp_bytes(n, text["intermediate_size"], b) + n * d * b
    # The router's fp32 hidden copy and its [N, E] fp32 logits, scores, biased and masked scores; the shared
    # experts' MLP (run after the routed experts, whose output stays alive) and the routed output.
    moe_block = norm + n * d * F32 + 4 * n * experts * F32 + gated_mlp_bytes(n, shared, b) + 2 * n * d * b
    # Per routed row in the eager loop: the gate/up output, the activation and the product (its input and
    # output rows are the planner's own terms).
    expert_row = 4 * inter * b
    return ActivationModel(tokens=n, carried=carried, phases=phases, moe_block=moe_block,
                           expert_row_bytes=expert_row, latent_dim=d, top_k=text["num_experts_per_tok"])
