"""The default shared-input probe of a transformers-native MoE: the checkpoint's own config with every width
this table knows made tiny, its layers kept (so every layer kind occurs as in the real model, whatever rule
places them: ``mlp_only_layers``, ``first_k_dense_replace``, ``layer_types``), built from transformers' class.

The rules the probe yields carry no layer index (``quant/shared_inputs.py``), so keeping every layer changes
nothing but the probe's cost, a few milliseconds per tiny layer. A width the table does not know stays as the
config sets it: a model with one (a linear-attention state size, say) gives its own ``probe_model``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...spec.probe import random_probe_model

TINY_WIDTHS = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 32, "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
    "topk_group": 1, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 8, "use_cache": False,
}
EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts")
# MLA: keys and values have their own heads (no grouped-query sharing), and head_dim follows the rope width.
MLA_WIDTHS = {"num_key_value_heads": 2, "head_dim": 8}


def tiny_config(config: Any) -> Any:
    """A fresh config of the same class with the known widths made tiny (token ids inside the tiny vocab)."""
    cfg = {k: v for k, v in config.to_dict().items() if k != "quantization_config"}
    widths = {**TINY_WIDTHS, **(MLA_WIDTHS if "kv_lora_rank" in cfg else {})}
    # An expert count of 0 (a dense model of the family) stays 0: the probe must not grow MoE layers.
    cfg.update({k: v for k, v in widths.items() if k in cfg and (cfg[k] or k not in EXPERT_COUNTS)})
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(cfg.get(token), int):
            cfg[token] = cfg["vocab_size"] - 1
    text = type(config)(**cfg)
    text._experts_implementation = "eager"
    return text


def probe_model(model_cls: type, config: Any, device: torch.device) -> tuple[nn.Module, str]:
    """``QuantSpec.probe_model``: (the tiny model in fp32 on ``device``, small random weights; no name prefix)."""
    return random_probe_model(lambda: model_cls(tiny_config(config)), device), ""
