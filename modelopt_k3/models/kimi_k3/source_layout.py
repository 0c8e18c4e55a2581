"""Which routed experts a Kimi-K3 checkpoint must store, read from config.json alone (no remote code).

The rules are the remote code's (llm-compressor branch kimi-k3-example @ a2b104f8,
src/llmcompressor/modeling/kimi_k3/modeling_kimi_linear.py, ``KimiDecoderLayer.__init__`` and
``KimiSparseMoeBlock.__init__``; defaults from configuration_kimi_k3.py ``KimiLinearConfig``):
layer ``i`` has a MoE block iff ``num_experts`` is set, ``i >= first_k_dense_replace`` and
``i % moe_layer_freq == 0``; its experts are ``w1``/``w3`` ``[moe_intermediate_size, Dl]`` and ``w2``
``[Dl, moe_intermediate_size]`` with ``Dl = routed_expert_hidden_size or hidden_size``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ...spec import ExpertsLayout
from ...spec.config import positive_int

EXPERTS_MODULE = "language_model.model.layers.{layer}.block_sparse_moe.experts"


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def _field(text: Mapping[str, Any], name: str) -> int:
    return positive_int(text, name, label=f"config.json text_config.{name}")


# Every text_config field the tools read without building the model (source check, memory planner, the
# converter's dense check), each a positive integer: checked up front, so a missing one is one line naming it.
CONFIG_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim")
MOE_CONFIG_FIELDS = ("num_experts", "moe_intermediate_size", "num_experts_per_token")


def check_config_fields(config: Mapping[str, Any]) -> None:
    text = _text_config(config)
    for name in CONFIG_FIELDS + (MOE_CONFIG_FIELDS if text.get("num_experts") is not None else ()):
        _field(text, name)
    if (text.get("first_k_dense_replace") or 0) > 0:
        _field(text, "intermediate_size")


_LAYERS = r"language_model\.model\.layers\.(?P<layer>\d+)\."


def dense_layout(config: Mapping[str, Any]) -> tuple[tuple[str, tuple[int, ...] | None, str], ...]:
    """(key regex, shape, the config fields it follows) for the dense tensors whose shapes config.json fixes;
    shape None: the key only needs its layer < num_hidden_layers. What the converter checks without a model."""
    text = _text_config(config)
    d, vocab = _field(text, "hidden_size"), _field(text, "vocab_size")
    rules: list[tuple[str, tuple[int, ...] | None, str]] = [
        (r"language_model\.model\.embed_tokens\.weight", (vocab, d), "vocab_size x hidden_size"),
        (r"language_model\.lm_head\.weight", (vocab, d), "vocab_size x hidden_size"),
        (r"language_model\.model\.norm\.weight", (d,), "hidden_size"),
        (_LAYERS + r"(input|post_attention)_layernorm\.weight", (d,), "hidden_size"),
    ]
    if (text.get("first_k_dense_replace") or 0) > 0:
        inter = _field(text, "intermediate_size")
        rules += [(_LAYERS + r"mlp\.(gate|up)_proj\.weight", (inter, d), "intermediate_size x hidden_size"),
                  (_LAYERS + r"mlp\.down_proj\.weight", (d, inter), "hidden_size x intermediate_size")]
    rules.append((_LAYERS, None, f"num_hidden_layers={_field(text, 'num_hidden_layers')}"))
    return tuple(rules) + tuple((re.escape(key), shape, why) for key, (shape, why) in _vision_keys(config).items())


def _moe_layers(text: Mapping[str, Any]) -> list[int]:
    """The decoder layers with a ``block_sparse_moe`` (KimiDecoderLayer: from first_k_dense_replace, every
    moe_layer_freq-th), none without ``num_experts``."""
    if text.get("num_experts") is None:
        return []
    first_k = text.get("first_k_dense_replace", 0) or 0
    freq = text.get("moe_layer_freq", 1) or 1
    return [i for i in range(_field(text, "num_hidden_layers")) if i >= first_k and i % freq == 0]


def _kda_keys(lin: Mapping[str, Any]) -> list[str]:
    """A KimiDeltaAttention's tensors (q/k/v with their short convolutions, the decay gate, beta, the output gate
    full-rank or low-rank as ``use_full_rank_gate`` says, the gated norm, ``o_proj``)."""
    keys = [f"{p}_proj.weight" for p in ("q", "k", "v", "f_a", "f_b", "b", "o")]
    keys += [f"{p}_conv1d.weight" for p in ("q", "k", "v")] + ["A_log", "dt_bias", "o_norm.weight"]
    full_rank = lin.get("use_full_rank_gate")
    if full_rank is not None:  # either form otherwise: left to the model-building check
        keys += ["g_proj.weight"] if full_rank else ["g_a_proj.weight", "g_b_proj.weight"]
    return keys


def _mla_keys(text: Mapping[str, Any]) -> list[str]:
    """A KimiMLAAttention's tensors (q low-rank when ``q_lora_rank`` is set, the joint kv projection and its norm,
    ``kv_b_proj``, ``o_proj``, the output gate with ``mla_use_output_gate``)."""
    q = ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"] if text.get("q_lora_rank") else ["q_proj.weight"]
    keys = [*q, "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]
    return keys + (["g_proj.weight"] if text.get("mla_use_output_gate") else [])


def dense_required(config: Mapping[str, Any]) -> tuple[str, ...]:
    """Dense keys every Kimi-K3 checkpoint of this config stores (the module tree of kimi_k3_reference.md): the
    embedding and final norm, ``lm_head`` unless tied; per layer its norms, its attention's tensors (KDA for the
    1-indexed ``linear_attn_config.kda_layers``, MLA for every other layer), a dense layer's MLP, an MoE layer's
    router, score-correction bias, shared experts (``num_shared_experts``) and latent projections
    (``routed_expert_hidden_size``, its norm with ``latent_moe_use_norm``); AttnRes' norms and projections with
    ``attn_res_block_size``; the vision tower and projector of ``vision_config`` (``_vision_keys``)."""
    text = _text_config(config)
    base = "language_model.model"
    keys = [f"{base}.embed_tokens.weight", f"{base}.norm.weight"]
    if not (config.get("tie_word_embeddings") or text.get("tie_word_embeddings")):
        keys.append("language_model.lm_head.weight")
    attn_res = text.get("attn_res_block_size") is not None
    if attn_res:
        keys += [f"{base}.output_attn_res_norm.weight", f"{base}.output_attn_res_proj.weight"]
    lin = text.get("linear_attn_config") or {}
    kda = {int(i) - 1 for i in (lin.get("kda_layers") or ())}
    moe = set(_moe_layers(text))
    shared = (text.get("num_shared_experts") or 0) > 0
    latent = text.get("routed_expert_hidden_size") is not None
    for i in range(_field(text, "num_hidden_layers")):
        layer = f"{base}.layers.{i}"
        keys += [f"{layer}.input_layernorm.weight", f"{layer}.post_attention_layernorm.weight"]
        if attn_res:
            keys += [f"{layer}.{part}" for part in ("self_attention_res_norm.weight", "self_attention_res_proj.weight",
                                                   "mlp_res_norm.weight", "mlp_res_proj.weight")]
        keys += [f"{layer}.self_attn.{k}" for k in (_kda_keys(lin) if i in kda else _mla_keys(text))]
        if i in moe:
            moe_block = f"{layer}.block_sparse_moe"
            keys += [f"{moe_block}.gate.weight", f"{moe_block}.gate.e_score_correction_bias"]
            if shared:
                keys += [f"{moe_block}.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")]
            if latent:
                keys += [f"{moe_block}.routed_expert_down_proj.weight", f"{moe_block}.routed_expert_up_proj.weight"]
                keys += [f"{moe_block}.routed_expert_norm.weight"] if text.get("latent_moe_use_norm") else []
        else:
            keys += [f"{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    return (*keys, *_vision_keys(config))


def _vision_field(vision: Mapping[str, Any], name: str) -> int:
    return positive_int(vision, name, label=f"config.json vision_config.{name}")


def _vision_keys(config: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """The MoonViT tower's and PatchMergerMLPV2 projector's tensors with the shapes ``vision_config`` fixes
    (kimi_k3_reference.md section 5): the patch embedding Conv2d and its position table, per encoder block
    ``norm0``/``norm1`` (RMSNorm), the fused ``wqkv`` and ``wo``, the two-layer MLP, the final norm; the
    projector's two Linears over ``merge_kernel_size`` merged patches and its ``post_norm``. A bias is required
    only where its flag is set true (K3 sets them all false; the remote code's defaults differ between its
    classes, so an absent flag decides nothing). Empty without a ``vision_config``."""
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        return {}
    d, qkv, inter = (_vision_field(vision, f) for f in ("vt_hidden_size", "qkv_hidden_size", "vt_intermediate_size"))
    patch, text_d = _vision_field(vision, "patch_size"), _vision_field(vision, "text_hidden_size")
    kh, kw = vision.get("merge_kernel_size") or (2, 2)
    merged = _vision_field(vision, "mm_hidden_size") * int(kh) * int(kw)
    tower, blocks = "vision_tower", range(_vision_field(vision, "vt_num_hidden_layers"))
    keys: dict[str, tuple[tuple[int, ...], str]] = {
        f"{tower}.patch_embed.proj.weight": ((d, 3, patch, patch), "vt_hidden_size x 3 x patch_size x patch_size"),
        f"{tower}.patch_embed.pos_emb.weight": (
            (_vision_field(vision, "init_pos_emb_height"), _vision_field(vision, "init_pos_emb_width"), d),
            "init_pos_emb_height x init_pos_emb_width x vt_hidden_size"),
        f"{tower}.encoder.final_layernorm.weight": ((d,), "vt_hidden_size"),
        "mm_projector.proj.0.weight": ((merged, merged), "merged patch width (mm_hidden_size x merge kernel), twice"),
        "mm_projector.proj.2.weight": ((text_d, merged), "text_hidden_size x merged patch width"),
        "mm_projector.post_norm.weight": ((text_d,), "text_hidden_size"),
    }
    biases = {f"{tower}.patch_embed.proj.bias": ((d,), "patch_embed_proj_bias")} if vision.get(
        "patch_embed_proj_bias") is True else {}
    for i in blocks:
        block = f"{tower}.encoder.blocks.{i}"
        keys |= {f"{block}.norm0.weight": ((d,), "vt_hidden_size"), f"{block}.norm1.weight": ((d,), "vt_hidden_size"),
                 f"{block}.wqkv.weight": ((3 * qkv, d), "3 x qkv_hidden_size x vt_hidden_size"),
                 f"{block}.wo.weight": ((d, qkv), "vt_hidden_size x qkv_hidden_size"),
                 f"{block}.mlp.fc0.weight": ((inter, d), "vt_intermediate_size x vt_hidden_size"),
                 f"{block}.mlp.fc1.weight": ((d, inter), "vt_hidden_size x vt_intermediate_size")}
        if vision.get("attn_bias") is True:
            biases |= {f"{block}.wqkv.bias": ((3 * qkv,), "attn_bias"), f"{block}.wo.bias": ((d,), "attn_bias")}
        if vision.get("linear_bias") is True:
            biases |= {f"{block}.mlp.fc0.bias": ((inter,), "linear_bias"), f"{block}.mlp.fc1.bias": ((d,), "linear_bias")}
    return keys | biases


def expert_layout(config: Mapping[str, Any]) -> tuple[ExpertsLayout, ...]:
    text = _text_config(config)
    if text.get("num_experts") is None:
        return ()
    num_experts = _field(text, "num_experts")
    inter = _field(text, "moe_intermediate_size")
    latent = text.get("routed_expert_hidden_size")
    hidden = _field(text, "routed_expert_hidden_size" if latent is not None else "hidden_size")
    first_k = text.get("first_k_dense_replace", 0) or 0
    freq = text.get("moe_layer_freq", 1) or 1
    layers = _moe_layers(text)
    source = (
        f"num_experts={num_experts}, moe_intermediate_size={inter}, "
        f"{'routed_expert_hidden_size' if latent is not None else 'hidden_size'}={hidden}, MoE layers "
        f"{layers[0] if layers else '-'}..{layers[-1] if layers else '-'} (num_hidden_layers="
        f"{text.get('num_hidden_layers')}, first_k_dense_replace={first_k}, moe_layer_freq={freq})"
    )
    projections = {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)}
    return tuple(ExpertsLayout(EXPERTS_MODULE.format(layer=i), num_experts, projections, source) for i in layers)
