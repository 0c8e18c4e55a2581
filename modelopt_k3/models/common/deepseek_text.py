"""The config fields of the DeepSeek-V3 text model the tools read, checked before anything reads them; shared by
``deepseek_v3`` and ``kimi_k25`` (its ``text_config``), since no model package imports another."""

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
    mtp = config.get("num_nextn_predict_layers", 0)
    if not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 0:
        raise SpecError(f"config.json num_nextn_predict_layers = {mtp!r}; a non-negative integer is needed")
