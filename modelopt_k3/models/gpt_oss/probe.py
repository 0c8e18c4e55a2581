"""A tiny GPT-OSS built from transformers' own classes, for the shared-input probe (``quant/shared_inputs.py``).

The checkpoint's config shrunk to small widths and two layers (one sliding, one full attention), so every
module pattern of the real model occurs; transformers' own ``GptOssForCausalLM`` (its experts are not
Linears, so only attention and the head are probed).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers import GptOssForCausalLM

from ...spec.probe import random_probe_model

_WIDTHS = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 32, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
           "num_hidden_layers": 2, "use_cache": False}


def probe_model(model_cls: type, config: Any, device: torch.device) -> tuple[nn.Module, str]:
    """(tiny model in fp32 on ``device`` with small random weights, prefix of its names in the checkpoint: none)."""
    tiny = copy.deepcopy(config)
    for key, value in _WIDTHS.items():
        setattr(tiny, key, value)
    tiny.layer_types = ["sliding_attention", "full_attention"]
    tiny.quantization_config = None
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if getattr(tiny, token, None) is not None:
            setattr(tiny, token, tiny.vocab_size - 1)
    tiny._attn_implementation = "eager"
    tiny._experts_implementation = "eager"  # not the run's (an expert-parallel route needs a placement)
    return random_probe_model(lambda: GptOssForCausalLM(tiny), device), ""
