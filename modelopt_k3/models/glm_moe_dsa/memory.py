"""GLM-5's calibration activations for the memory planner (transformers' ``GlmMoeDsa*`` forward).

Counted from transformers 5.25's ``modeling_glm_moe_dsa.py``: DeepSeek-V3's MLA (latent ``kv_b_proj``
expansion) under the indexer's boolean mask, which sends SDPA down its math path (fp32 copies and scores), and
the DSA indexer of every layer, whose peak comes first and is freed before the attention's: its ``wq_b`` queries
and ``wk`` key, the fp32 key ``torch.matmul`` broadcasts to ``[B, S, index_head_dim, S]`` when B > 1 (the largest
tensor: 8 GiB per 4096-token sequence at GLM-5's 128), the fp32 ``[B, S, H_idx, S]`` scores and their ReLU, the
``[B, S, S]`` index scores; then the top-k indices and the boolean masks; dense first layers' SiLU MLP; the
router's fp32 logits and scores; the shared experts. Upper-bound style, measured against the stand-in's own
forward by ``tests/memory/test_activation_models.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...memory.activations import ActivationModel, gated_mlp_bytes

F32 = 4


def indexer_bytes(text: Mapping, batch: int, seq: int, b: int) -> int:
    """The DSA indexer's tensors alive at its peak (module docstring); freed, but for the top-k indices and the
    index mask, before the attention's own scores exist."""
    n, heads, dim = batch * seq, text.get("index_n_heads") or 32, text.get("index_head_dim") or 128
    return (n * heads * dim * 3 * b + n * dim * 3 * b  # queries (projected, rotated, concatenated), key likewise
            # the fp32 key [B, 1, D, S] that matmul broadcasts to [B, S, D, S]: a copy for B > 1 (measured; for
            # B = 1 torch folds the query's batch dims instead)
            + (batch * seq * dim * seq * F32 if batch > 1 else 0)
            + 2 * batch * heads * seq * seq * F32  # fp32 scores and their ReLU
            + n * heads * F32 + 2 * batch * seq * seq * F32)  # head weights; index scores and the masked copy


def activation_memory(text: Mapping, batch: int, seq: int, dtype_bytes: int) -> ActivationModel:
    b, n = dtype_bytes, batch * seq
    d, heads, vocab = text["hidden_size"], text["num_attention_heads"], text["vocab_size"]
    nope, rope, dv = text["qk_nope_head_dim"], text["qk_rope_head_dim"], text["v_head_dim"]
    dq, q_lora, kv_lora = nope + rope, text.get("q_lora_rank") or 0, text["kv_lora_rank"]
    experts, inter = text["n_routed_experts"], text["moe_intermediate_size"]
    shared = inter * (text.get("n_shared_experts") or 0)

    carried = 3 * n * d * b + batch * seq * seq * b  # residual, layer input/output, the causal mask
    norm = n * d * 2 * F32
    mla = (
        n * q_lora * (b + 2 * F32) + n * heads * dq * 3 * b + n * (kv_lora + rope) * (b + 2 * F32)
        + n * heads * ((nope + dv) + dq + dv) * b + n * heads * dv * 2 * b + n * d * b
    )
    topk = min(text.get("index_topk") or 2048, seq)
    selected = n * topk * 4 + 3 * batch * seq * seq  # int32 top-k indices; the index mask, its negation, the new mask
    # SDPA under that boolean mask (measured on CPU: its math path): fp32 q/k/v copies, two fp32 [B, H, S, S]
    # score tensors and the mask as an additive one in the weight dtype.
    attention = n * heads * (2 * dq + dv) * F32 + 2 * batch * heads * seq * seq * F32 + batch * seq * seq * b
    peak = max(attention, indexer_bytes(text, batch, seq, b))
    phases = {"MLA + DSA indexer": norm + mla + selected + peak,
              "embedding + logits": n * vocab * b}
    if (text.get("first_k_dense_replace") or 0) > 0:
        phases["dense MLP"] = norm + gated_mlp_bytes(n, text["intermediate_size"], b) + n * d * b
    moe_block = norm + n * d * F32 + 4 * n * experts * F32 + gated_mlp_bytes(n, shared, b) + 2 * n * d * b
    return ActivationModel(tokens=n, carried=carried, phases=phases, moe_block=moe_block,
                           expert_row_bytes=4 * inter * b, latent_dim=d, top_k=text["num_experts_per_tok"])
