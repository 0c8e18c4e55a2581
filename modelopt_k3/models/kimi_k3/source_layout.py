"""Which routed experts a Kimi-K3 checkpoint must store, read from config.json alone (no remote code).

The rules are the remote code's (llm-compressor branch kimi-k3-example @ a2b104f8,
src/llmcompressor/modeling/kimi_k3/modeling_kimi_linear.py, ``KimiDecoderLayer.__init__`` and
``KimiSparseMoeBlock.__init__``; defaults from configuration_kimi_k3.py ``KimiLinearConfig``):
layer ``i`` has a MoE block iff ``num_experts`` is set, ``i >= first_k_dense_replace`` and
``i % moe_layer_freq == 0``; its experts are ``w1``/``w3`` ``[moe_intermediate_size, Dl]`` and ``w2``
``[Dl, moe_intermediate_size]`` with ``Dl = routed_expert_hidden_size or hidden_size``.
"""

from __future__ import annotations

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
    return tuple(rules)


def _moe_layers(text: Mapping[str, Any]) -> list[int]:
    """The decoder layers with a ``block_sparse_moe`` (KimiDecoderLayer: from first_k_dense_replace, every
    moe_layer_freq-th), none without ``num_experts``."""
    if text.get("num_experts") is None:
        return []
    first_k = text.get("first_k_dense_replace", 0) or 0
    freq = text.get("moe_layer_freq", 1) or 1
    return [i for i in range(_field(text, "num_hidden_layers")) if i >= first_k and i % freq == 0]


def dense_required(config: Mapping[str, Any]) -> tuple[str, ...]:
    """Dense keys every Kimi-K3 checkpoint of this config stores (the module tree of kimi_k3_reference.md): the
    embedding and final norm, ``lm_head`` unless tied, each layer's two norms and attention ``o_proj`` (KDA and
    MLA both have one), a dense layer's MLP, an MoE layer's router, its score-correction bias and (with
    ``num_shared_experts``) its shared experts. Attention internals, which differ between KDA and MLA layers, and
    the optional residual-attention and latent tensors are left to the model-building check."""
    text = _text_config(config)
    base = "language_model.model"
    keys = [f"{base}.embed_tokens.weight", f"{base}.norm.weight"]
    if not (config.get("tie_word_embeddings") or text.get("tie_word_embeddings")):
        keys.append("language_model.lm_head.weight")
    moe = set(_moe_layers(text))
    shared = (text.get("num_shared_experts") or 0) > 0
    for i in range(_field(text, "num_hidden_layers")):
        layer = f"{base}.layers.{i}"
        keys += [f"{layer}.input_layernorm.weight", f"{layer}.post_attention_layernorm.weight",
                 f"{layer}.self_attn.o_proj.weight"]
        if i in moe:
            keys += [f"{layer}.block_sparse_moe.gate.weight", f"{layer}.block_sparse_moe.gate.e_score_correction_bias"]
            if shared:
                keys += [f"{layer}.block_sparse_moe.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")]
        else:
            keys += [f"{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    return tuple(keys)


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
