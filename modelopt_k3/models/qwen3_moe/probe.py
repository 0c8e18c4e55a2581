"""A tiny Qwen3-MoE of transformers' own classes, for the shared-input probe (``quant/shared_inputs.py``).

The checkpoint's config with small widths and one layer of each MLP kind it has (dense ``Qwen3MoeMLP``
first, then a sparse block), so every module pattern of the real model occurs once. The routed experts are
transformers' fused ``Qwen3MoeExperts`` (no ``nn.Linear``: the probe's hooks never see them; their gate/up
sharing is the spec's ``shared_scale_groups``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ...spec.probe import random_probe_model
from .source_layout import moe_layers

_WIDTHS = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 32, "moe_intermediate_size": 16,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_experts": 4,
           "num_experts_per_tok": 2, "decoder_sparse_step": 1, "use_cache": False}


def tiny_config(config: Any) -> Any:
    text = copy.deepcopy(config)
    cfg = text.to_dict()
    moe = set(moe_layers(cfg))
    kinds = sorted({i in moe for i in range(cfg["num_hidden_layers"])})  # False (dense) first
    for key, value in _WIDTHS.items():
        setattr(text, key, value)
    text.num_hidden_layers = len(kinds)
    text.mlp_only_layers = [i for i, sparse in enumerate(kinds) if not sparse]
    if True not in kinds:
        text.num_experts = 0
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if getattr(text, token, None) is not None:
            setattr(text, token, text.vocab_size - 1)
    text._experts_implementation = "eager"
    return text


def probe_model(model_cls: type, config: Any, device: torch.device) -> tuple[nn.Module, str]:
    """(tiny model in fp32 on ``device`` with small random weights, prefix of its names in the checkpoint)."""
    return random_probe_model(lambda: model_cls(tiny_config(config)), device), ""
