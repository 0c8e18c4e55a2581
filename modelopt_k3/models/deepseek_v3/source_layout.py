"""What a DeepSeek-V3 config.json must hold for the tools to read it (no model built).

transformers 5.24 ``DeepseekV3DecoderLayer``: layer ``i`` holds a ``DeepseekV3MoE`` (routed experts,
``n_shared_experts`` shared experts, the sigmoid group-limited router) iff ``i >= first_k_dense_replace``,
else a dense ``DeepseekV3MLP``; ``num_nextn_predict_layers`` MTP layers are stored as extra layers
``model.layers.{num_hidden_layers + j}`` that transformers does not build.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...spec import SpecError
from ...spec.config import positive_int

CONFIG_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
                 "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "kv_lora_rank",
                 "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group")


def check_config_fields(config: Mapping[str, Any]) -> None:
    for name in CONFIG_FIELDS:
        positive_int(config, name)
    first = config.get("first_k_dense_replace", 0)
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise SpecError(f"config.json first_k_dense_replace = {first!r}; a non-negative integer is needed")
    if config["n_routed_experts"] % config["n_group"]:
        raise SpecError(f"config.json n_routed_experts={config['n_routed_experts']} is not a multiple of "
                        f"n_group={config['n_group']} (the router groups experts evenly)")
    if config.get("num_nextn_predict_layers"):
        raise SpecError(f"config.json num_nextn_predict_layers={config['num_nextn_predict_layers']}: MTP layers are "
                        "not supported yet (transformers does not build them; they would have to be copied as stored)")


def moe_layers(config: Mapping[str, Any]) -> list[int]:
    """Indices of the layers with routed experts (``DeepseekV3DecoderLayer.__init__``'s rule)."""
    return list(range(config.get("first_k_dense_replace", 0), positive_int(config, "num_hidden_layers")))
