"""Nemotron-H's calibration activations for the memory planner (transformers' ``NemotronH*`` forward on CPU).

Counted from transformers 5.25's ``modeling_nemotron_h.py``, upper-bound style: the Mamba-2 mixer runs the
PyTorch chunked scan (``mamba2_chunk_scan``; no ``mamba_ssm`` kernels on CPU), all of it in fp32: the input and
B/C repeated to every head, the within-chunk ``[B, chunks, chunk, chunk, heads]`` decay, scores and their product,
the per-chunk ``[heads, head_dim, state]`` states; attention is SDPA over GQA heads; the MoE block routes in fp32
over the full hidden state, projects to the latent width, and adds the shared expert (relu2).
"""

from __future__ import annotations

from collections.abc import Mapping

F32 = 4


def activation_memory(text: Mapping, batch: int, seq: int, dtype_bytes: int):
    from ...memory.activations import ActivationModel

    b, n = dtype_bytes, batch * seq
    d, heads, vocab = text["hidden_size"], text["num_attention_heads"], text["vocab_size"]
    head_dim = text.get("head_dim") or d // heads
    kv_heads = text.get("num_key_value_heads") or heads
    m_heads, m_dim, state = text["mamba_num_heads"], text["mamba_head_dim"], text["ssm_state_size"]
    chunk = text.get("chunk_size") or 128
    inner, conv = m_heads * m_dim, m_heads * m_dim + 2 * (text.get("n_groups") or 1) * state
    experts, inter = text["n_routed_experts"], text["moe_intermediate_size"]
    latent = text.get("moe_latent_size") or d
    shared = text.get("moe_shared_expert_intermediate_size") or inter

    carried = 3 * n * d * b  # residual, layer input and output
    norm = n * d * 2 * F32  # RMSNorm's fp32 copies
    chunks = n // chunk + 2 * batch  # chunks per sequence, rounded up, plus each sequence's initial state
    mamba = (
        n * (inner + conv + m_heads) * b + 2 * n * conv * b  # in_proj output, the conv input and output
        + 4 * n * inner * F32  # the scan's fp32 input, D residual, intra- and inter-chunk outputs
        + 2 * n * m_heads * state * F32  # B and C repeated to every head
        + 3 * n * chunk * m_heads * F32  # the within-chunk decay L, scores G and their product M
        + 3 * chunks * m_heads * m_dim * state * F32  # chunk states, with the previous ones, and the new ones
        + 2 * n * inner * b + n * d * b  # the gated norm and its output, out_proj's output
    )
    attention = (
        n * (heads + 2 * kv_heads) * head_dim * b  # q/k/v outputs
        + 2 * n * heads * head_dim * b  # keys and values repeated to every query head
        + 2 * n * heads * head_dim * b + n * d * b  # the attention output, its reshape, o_proj's output
    )
    phases = {"mamba": norm + mamba, "attention": norm + attention, "embedding + logits": n * vocab * (b + F32)}
    # The router's fp32 logits, scores and choice; the latent input and output; the shared expert (relu2).
    moe_block = norm + n * experts * 3 * F32 + 2 * n * latent * b + n * shared * 2 * b + 2 * n * d * b
    return ActivationModel(tokens=n, carried=carried, phases=phases, moe_block=moe_block,
                           expert_row_bytes=2 * inter * b, latent_dim=latent, top_k=text["num_experts_per_tok"])
