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
    layers = [i for i in range(_field(text, "num_hidden_layers")) if i >= first_k and i % freq == 0]
    source = (
        f"num_experts={num_experts}, moe_intermediate_size={inter}, "
        f"{'routed_expert_hidden_size' if latent is not None else 'hidden_size'}={hidden}, MoE layers "
        f"{layers[0] if layers else '-'}..{layers[-1] if layers else '-'} (num_hidden_layers="
        f"{text.get('num_hidden_layers')}, first_k_dense_replace={first_k}, moe_layer_freq={freq})"
    )
    projections = {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)}
    return tuple(ExpertsLayout(EXPERTS_MODULE.format(layer=i), num_experts, projections, source) for i in layers)
