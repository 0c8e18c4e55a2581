"""Which tensors a Qwen3-MoE checkpoint must store, read from config.json alone (no model built).

The rules are transformers 5.24's (``models/qwen3_moe/modeling_qwen3_moe.py``): ``Qwen3MoeDecoderLayer.__init__``
builds a ``Qwen3MoeSparseMoeBlock`` at layer ``i`` iff ``i not in mlp_only_layers`` and ``num_experts > 0`` and
``(i + 1) % decoder_sparse_step == 0``, else a dense ``Qwen3MoeMLP`` of ``intermediate_size``. A MoE layer's
checkpoint holds ``mlp.gate.weight [num_experts, hidden]`` (the router) and per expert ``gate_proj``/``up_proj``
``[moe_intermediate_size, hidden]`` and ``down_proj [hidden, moe_intermediate_size]`` (the hub's
Qwen/Qwen3-30B-A3B and Qwen3-235B-A22B layout, which transformers' ``qwen2_moe`` conversion mapping fuses).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...spec import ExpertsLayout, SpecError
from ...spec.config import positive_int

EXPERTS_MODULE = "model.layers.{layer}.mlp.experts"
CONFIG_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                 "intermediate_size")
MOE_CONFIG_FIELDS = ("num_experts", "moe_intermediate_size", "num_experts_per_tok", "decoder_sparse_step")


def _head_dim(config: Mapping[str, Any]) -> int:
    # Qwen3MoeAttention: getattr(config, "head_dim", hidden_size // num_attention_heads).
    if config.get("head_dim") is not None:
        return positive_int(config, "head_dim")
    return positive_int(config, "hidden_size") // positive_int(config, "num_attention_heads")


def check_config_fields(config: Mapping[str, Any]) -> None:
    moe = bool(config.get("num_experts"))
    for name in CONFIG_FIELDS + (MOE_CONFIG_FIELDS if moe else ()):
        positive_int(config, name)
    only = config.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise SpecError(f"config.json mlp_only_layers = {only!r}; a list of layer indices is needed")
    _head_dim(config)


def moe_layers(config: Mapping[str, Any]) -> list[int]:
    """Indices of the layers with a sparse MoE block (``Qwen3MoeDecoderLayer.__init__``'s rule)."""
    if not config.get("num_experts"):
        return []
    only = set(config.get("mlp_only_layers") or [])
    step = positive_int(config, "decoder_sparse_step")
    return [i for i in range(positive_int(config, "num_hidden_layers")) if i not in only and (i + 1) % step == 0]


def expert_layout(config: Mapping[str, Any]) -> tuple[ExpertsLayout, ...]:
    layers = moe_layers(config)
    if not layers:
        return ()
    num_experts, inter, hidden = (positive_int(config, k) for k in ("num_experts", "moe_intermediate_size", "hidden_size"))
    source = (f"num_experts={num_experts}, moe_intermediate_size={inter}, hidden_size={hidden}, MoE layers {layers} "
              f"(num_hidden_layers={config.get('num_hidden_layers')}, decoder_sparse_step="
              f"{config.get('decoder_sparse_step')}, mlp_only_layers={config.get('mlp_only_layers') or []})")
    projections = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    return tuple(ExpertsLayout(EXPERTS_MODULE.format(layer=i), num_experts, projections, source) for i in layers)


def _layer_alternation(layers: list[int]) -> str:
    return "|".join(str(i) for i in layers) if layers else "(?!)"


def dense_layout(config: Mapping[str, Any]) -> tuple[tuple[str, tuple[int, ...] | None, str], ...]:
    """(key regex, shape, the config fields it follows) for the dense tensors whose shapes config.json fixes;
    shape None: the key only needs its layer < num_hidden_layers."""
    d, vocab, n = (positive_int(config, k) for k in ("hidden_size", "vocab_size", "num_hidden_layers"))
    heads, kv, hd = positive_int(config, "num_attention_heads"), positive_int(config, "num_key_value_heads"), _head_dim(config)
    moe = moe_layers(config)
    dense = [i for i in range(n) if i not in moe]
    layer = r"model\.layers\.(?P<layer>\d+)\."
    rules: list[tuple[str, tuple[int, ...] | None, str]] = [
        (r"model\.embed_tokens\.weight", (vocab, d), "vocab_size x hidden_size"),
        (r"lm_head\.weight", (vocab, d), "vocab_size x hidden_size"),
        (r"model\.norm\.weight", (d,), "hidden_size"),
        (layer + r"(input|post_attention)_layernorm\.weight", (d,), "hidden_size"),
        (layer + r"self_attn\.q_proj\.weight", (heads * hd, d), "num_attention_heads*head_dim x hidden_size"),
        (layer + r"self_attn\.(k|v)_proj\.weight", (kv * hd, d), "num_key_value_heads*head_dim x hidden_size"),
        (layer + r"self_attn\.o_proj\.weight", (d, heads * hd), "hidden_size x num_attention_heads*head_dim"),
        (layer + r"self_attn\.(q|k)_norm\.weight", (hd,), "head_dim"),
    ]
    if moe:
        rules.append((rf"model\.layers\.(?P<layer>{_layer_alternation(moe)})\.mlp\.gate\.weight",
                      (positive_int(config, "num_experts"), d), "num_experts x hidden_size"))
    if dense:
        inter = positive_int(config, "intermediate_size")
        at = rf"model\.layers\.(?P<layer>{_layer_alternation(dense)})\.mlp\."
        rules += [(at + r"(gate|up)_proj\.weight", (inter, d), "intermediate_size x hidden_size"),
                  (at + r"down_proj\.weight", (d, inter), "hidden_size x intermediate_size")]
    rules.append((layer, None, f"num_hidden_layers={n}"))
    return tuple(rules)
