"""A tiny DeepSeek-V3 of transformers' own classes, for the shared-input probe (``quant/shared_inputs.py``).

The checkpoint's config with small widths and one layer of each MLP kind it has (a dense ``DeepseekV3MLP``
first, then a MoE layer), so every module pattern of the real model occurs once: the probe finds the
Linears that read one input (MLA's ``q_a_proj`` + ``kv_a_proj_with_mqa``; gate/up of the dense MLP and of
the shared experts). The routed experts are fused parameters (no ``nn.Linear``; their gate/up sharing is
the spec's ``shared_scale_groups``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...spec.probe import random_probe_model

_WIDTHS = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 32, "moe_intermediate_size": 16,
           "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16,
           "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4,
           "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "use_cache": False}


def tiny_config(config: Any) -> Any:
    """A fresh config of the same class (derived fields such as ``head_dim`` recomputed from the widths)."""
    cfg = {k: v for k, v in config.to_dict().items() if k not in ("quantization_config", "head_dim")}
    moe = cfg["first_k_dense_replace"] < cfg["num_hidden_layers"]
    dense = cfg["first_k_dense_replace"] > 0
    cfg.update(_WIDTHS, num_hidden_layers=int(dense) + int(moe), first_k_dense_replace=int(dense))
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if cfg.get(token) is not None:
            cfg[token] = cfg["vocab_size"] - 1
    text = type(config)(**cfg)
    text._experts_implementation = "eager"
    return text


def probe_model(model_cls: type, config: Any, device: torch.device) -> tuple[nn.Module, str]:
    """(tiny model in fp32 on ``device`` with small random weights, prefix of its names in the checkpoint)."""
    return random_probe_model(lambda: model_cls(tiny_config(config)), device), ""
