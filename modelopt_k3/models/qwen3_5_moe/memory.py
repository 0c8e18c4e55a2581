"""Qwen3.5-MoE's calibration activations for the memory planner (transformers' ``Qwen3_5Moe*`` text forward).

Counted from transformers 5.25's ``modeling_qwen3_5_moe.py``. Two attention kinds, as ``layer_types`` places
them: gated attention (``q_proj`` emits the queries and an output gate, per-head ``q_norm``/``k_norm`` in fp32,
partial rotary, SDPA) and the gated delta net (``in_proj_qkv``/``in_proj_z``/``in_proj_b``/``in_proj_a``, the
short causal convolution, then the chunked delta rule in fp32: its PyTorch fallback holds l2-normed q/k, v,
the 64-wide chunk matrices and the fp32 output before the gated RMSNorm). The MoE block: the router's logits
and fp32 softmax, the shared expert (a gated MLP) and its sigmoid gate, the routed output. Upper-bound style,
measured against the stand-in's own forward by ``tests/models/qwen3_5_moe/test_qwen3_5_moe.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...memory.activations import ActivationModel, gated_mlp_bytes

F32 = 4
CHUNK = 64  # transformers' torch_chunk_gated_delta_rule chunk_size


def _text(config: Mapping) -> Mapping:
    return config["text_config"] if isinstance(config.get("text_config"), Mapping) else config


def activation_memory(config: Mapping, batch: int, seq: int, dtype_bytes: int) -> ActivationModel:
    text = _text(config)
    b, n = dtype_bytes, batch * seq
    d, heads, vocab = text["hidden_size"], text["num_attention_heads"], text["vocab_size"]
    head_dim = text.get("head_dim") or d // heads
    kv_heads = text.get("num_key_value_heads") or heads
    hk, hv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
    conv_dim = 2 * hk * dk + hv * dv

    carried = 3 * n * d * b  # residual, layer input and output
    norm = n * d * 2 * F32
    attention = (
        n * (2 * heads + 2 * kv_heads) * head_dim * b  # q_proj (queries and gate), k/v outputs
        + n * (heads + kv_heads) * head_dim * (2 * F32 + 2 * b)  # q_norm/k_norm's fp32 copies; rotated q and k
        + 2 * n * heads * head_dim * b  # keys and values repeated to every query head
        + n * heads * head_dim * 3 * b + n * d * b  # attention output, sigmoid gate product, o_proj's output
    )
    delta_net = (
        n * conv_dim * 3 * b  # in_proj_qkv's output, the convolution's output, its SiLU
        + n * hv * (2 * dk + dv) * F32 * 3  # q/k/v in fp32, l2-normed, repeated to the value heads
        + n * hv * CHUNK * F32 * 4  # the chunk's [C, C] decay and attention matrices, per token row
        + n * hv * dv * F32 * 3  # corrected values, the chunk outputs, the fp32 result
        + n * hv * dv * (2 * b + 2 * F32) + n * hv * 4 * F32  # z, the gated norm's fp32 copies; b, a, g, beta
        + n * d * b  # out_proj's output
    )
    phases = {"gated attention": norm + attention, "gated delta net": norm + delta_net,
              "embedding + logits": n * vocab * b}
    experts, inter = text["num_experts"], text["moe_intermediate_size"]
    shared = gated_mlp_bytes(n, text["shared_expert_intermediate_size"], b) + n * d * b + n * (b + F32)
    # The router's logits, their fp32 softmax and top-k values; the shared expert and its gate; the routed output.
    moe_block = norm + n * experts * (b + 2 * F32) + shared + n * d * b
    return ActivationModel(tokens=n, carried=carried, phases=phases, moe_block=moe_block,
                           expert_row_bytes=4 * inter * b, latent_dim=d, top_k=text["num_experts_per_tok"])
