"""A tiny Kimi-K3 language model built from the checkpoint's own classes, for the shared-input probe.

``quant/shared_inputs.py`` runs one forward of it with hooks on every Linear. The configuration is
the checkpoint's, shrunk: every width small, and one layer of each kind the checkpoint has (KDA or
MLA attention x dense MLP or MoE, dense kinds first as ``first_k_dense_replace`` requires), so every
module pattern of the real model occurs once. The routed experts are the checkpoint's own
(unfused) ``KimiBlockSparseMLP`` modules: a process-wide ``prepare`` patch is lifted while the tiny
model is built, so the probe never dispatches through an expert-parallel implementation.
"""

from __future__ import annotations

import copy
import sys
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ...spec.probe import random_probe_model
from .prepare import BLOCK_CLASS, find_block_module
from .shims import apply_class_shims

TEXT_CLASS = "KimiLinearForCausalLM"
# KimiK3ForConditionalGeneration holds the text model as ``language_model``: checkpoint names start so.
TEXT_PREFIX = "language_model."
_WIDTHS = {
    "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 2,
    "num_key_value_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_token": 2,
    "num_expert_group": 1, "topk_group": 1, "use_cache": False,
}


def _is_moe_layer(text, i: int) -> bool:
    # The remote KimiDecoderLayer's rule (modeling_kimi_linear.py).
    return bool(text.is_moe) and i >= text.first_k_dense_replace and i % text.moe_layer_freq == 0


def tiny_text_config(config: Any) -> Any:
    """The checkpoint's text config with small widths and one layer per (attention, MLP) kind."""
    text = copy.deepcopy(getattr(config, "text_config", config))
    kinds = list(dict.fromkeys((text.is_kda_layer(i), _is_moe_layer(text, i)) for i in range(text.num_hidden_layers)))
    layout = [k for k in kinds if not k[1]] + [k for k in kinds if k[1]]
    for key, value in _WIDTHS.items():
        setattr(text, key, value)
    text.head_dim = text.hidden_size // text.num_attention_heads
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if getattr(text, token, None) is not None:
            setattr(text, token, text.vocab_size - 1)
    if text.q_lora_rank is not None:
        text.q_lora_rank = 32
    if getattr(text, "routed_expert_hidden_size", None) is not None:
        text.routed_expert_hidden_size = 32
    text.num_hidden_layers = len(layout)
    text.first_k_dense_replace = sum(1 for _, moe in layout if not moe)
    text.moe_layer_freq = 1
    linear = dict(text.linear_attn_config or {})
    linear.update(num_heads=2, head_dim=16)
    linear["kda_layers"] = [i + 1 for i, (kda, _) in enumerate(layout) if kda]
    linear["full_attn_layers"] = [i + 1 for i, (kda, _) in enumerate(layout) if not kda]
    text.linear_attn_config = linear
    return text


@contextmanager
def _unpatched_block(model_cls: type):
    module = find_block_module(model_cls)
    current = getattr(module, BLOCK_CLASS)
    setattr(module, BLOCK_CLASS, getattr(current, "_modelopt_k3_original", current))
    try:
        yield
    finally:
        setattr(module, BLOCK_CLASS, current)


def probe_model(model_cls: type, config: Any, device: torch.device) -> tuple[nn.Module, str]:
    """(tiny text model in fp32 on ``device`` with small random weights, prefix of its names in the checkpoint)."""
    # The converter probes without a prepare: the hub code's transformers-4-era calls need the shims here too.
    apply_class_shims(model_cls)
    text_cls = getattr(sys.modules[model_cls.__module__], TEXT_CLASS)
    with _unpatched_block(model_cls):
        model = random_probe_model(lambda: text_cls(tiny_text_config(config)), device)
    return model, TEXT_PREFIX
