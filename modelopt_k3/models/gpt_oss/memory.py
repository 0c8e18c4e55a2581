"""GPT-OSS's calibration activations for the memory planner (transformers' ``GptOss*`` forward).

Counted from transformers 5.24's ``modeling_gpt_oss.py``, whose attention always runs eagerly here (its
sinks): the scores in the weight dtype, scaled, masked, concatenated with the sink column, shifted by their
maximum and softmaxed -- up to four ``[B, H, S, S + 1]`` tensors alive at once -- over keys and values repeated
to every query head; the router's biased logits; the experts' clamped SwiGLU (``experts.py``), whose per-row
temporaries are the gate/up output, both clamps, the sigmoid gain and the product. Upper-bound style,
measured against the stand-in's own forward by ``tests/memory/test_activation_models.py``.
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

    carried = 3 * n * d * b + 2 * batch * seq * seq * b  # residual, layer input/output; full and sliding masks
    norm = n * d * 2 * F32
    attention = (
        n * (heads + 2 * kv_heads) * head_dim * b  # q/k/v outputs
        + n * (heads + kv_heads) * head_dim * 2 * b  # the rotated queries and keys
        + 2 * n * heads * head_dim * b  # keys and values repeated to every query head
        + 4 * batch * heads * seq * (seq + 1) * b  # scores, masked, with sinks, shifted / softmaxed
        + n * heads * head_dim * 2 * b + n * d * b  # the attention output, its reshape, o_proj's output
    )
    phases = {"attention (eager, sinks)": norm + attention, "embedding + logits": n * vocab * b}
    moe_block = norm + n * experts * 2 * b + n * d * b  # the router's logits and top-k; the routed output
    return ActivationModel(tokens=n, carried=carried, phases=phases, moe_block=moe_block,
                           expert_row_bytes=7 * inter * b, latent_dim=d, top_k=text["num_experts_per_tok"])
