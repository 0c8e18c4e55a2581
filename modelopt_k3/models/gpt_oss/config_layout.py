"""What a GPT-OSS checkpoint must store, from config.json alone (transformers' ``GptOssConfig`` fields).

Every layer is MoE: ``num_local_experts`` experts of ``gate_up_proj [2 * intermediate_size, hidden_size]``
and ``down_proj [hidden_size, intermediate_size]`` (checkpoint ``[out, in]``; the view shows them per expert).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...spec import ExpertsLayout
from ...spec.config import positive_int

EXPERTS_MODULE = "model.layers.{layer}.mlp.experts"
CONFIG_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_local_experts",
                 "num_experts_per_tok", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")


def check_config_fields(config: Mapping[str, Any]) -> None:
    for name in CONFIG_FIELDS:
        positive_int(config, name)


def expert_layout(config: Mapping[str, Any]) -> tuple[ExpertsLayout, ...]:
    e, h, i = (positive_int(config, n) for n in ("num_local_experts", "hidden_size", "intermediate_size"))
    n = positive_int(config, "num_hidden_layers")
    source = f"num_local_experts={e}, hidden_size={h}, intermediate_size={i}, num_hidden_layers={n}"
    projections = {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}
    return tuple(ExpertsLayout(EXPERTS_MODULE.format(layer=layer), e, projections, source) for layer in range(n))


_LAYERS = r"model\.layers\.(?P<layer>\d+)\."


def dense_layout(config: Mapping[str, Any]) -> tuple[tuple[str, tuple[int, ...] | None, str], ...]:
    """(key regex, shape, why) for dense tensors config.json fixes; shape None: the layer must exist."""
    d, vocab, e, i = (positive_int(config, n) for n in ("hidden_size", "vocab_size", "num_local_experts", "intermediate_size"))
    return (
        (r"model\.embed_tokens\.weight", (vocab, d), "vocab_size x hidden_size"),
        (r"lm_head\.weight", (vocab, d), "vocab_size x hidden_size"),
        (r"model\.norm\.weight", (d,), "hidden_size"),
        (_LAYERS + r"(input|post_attention)_layernorm\.weight", (d,), "hidden_size"),
        (_LAYERS + r"mlp\.router\.weight", (e, d), "num_local_experts x hidden_size"),
        (_LAYERS + r"mlp\.experts\.gate_up_proj_bias", (e, 2 * i), "num_local_experts x 2*intermediate_size"),
        (_LAYERS + r"mlp\.experts\.down_proj_bias", (e, d), "num_local_experts x hidden_size"),
        (_LAYERS, None, f"num_hidden_layers={positive_int(config, 'num_hidden_layers')}"),
    )
