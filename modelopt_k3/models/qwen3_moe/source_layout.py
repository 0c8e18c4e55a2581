"""What a Qwen3-MoE config.json must hold before its checkpoint's layout is read off transformers' classes.

The layout itself (which tensors, what shapes) is the generic one, ``Qwen3MoeForCausalLM`` built on meta
(``models/common/layout.py``); its errors quote ``LAYOUT_FIELDS``, the fields that place the MoE layers
(``Qwen3MoeDecoderLayer``: a sparse block at layer ``i`` iff ``i not in mlp_only_layers``, ``num_experts > 0``
and ``(i + 1) % decoder_sparse_step == 0``). What transformers would silently default is checked here first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...spec import SpecError
from ...spec.config import positive_int

CONFIG_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                 "intermediate_size")
MOE_CONFIG_FIELDS = ("num_experts", "moe_intermediate_size", "num_experts_per_tok", "decoder_sparse_step")
LAYOUT_FIELDS = ("num_experts", "moe_intermediate_size", "hidden_size", "num_hidden_layers", "decoder_sparse_step",
                 "mlp_only_layers")


def check_config_fields(config: Mapping[str, Any]) -> None:
    moe = bool(config.get("num_experts"))
    for name in CONFIG_FIELDS + (MOE_CONFIG_FIELDS if moe else ()):
        positive_int(config, name)
    only = config.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise SpecError(f"config.json mlp_only_layers = {only!r}; a list of layer indices is needed")
    if config.get("head_dim") is not None:  # Qwen3MoeAttention: else hidden_size // num_attention_heads
        positive_int(config, "head_dim")
