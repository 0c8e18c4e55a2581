"""Qwen3.5-MoE's shared-input probe: the VLM at tiny widths, every text layer kept.

The default probe (``models/common/probe.py``) shrinks a flat config; Qwen3.5-MoE's widths sit in ``text_config``
and ``vision_config``, and the gated delta net has state widths the shared table does not know
(``linear_*_head_dim``, ``linear_num_*_heads``), so this probe sets them. The layers keep ``layer_types``, so both
attention kinds appear as the real config places them; the probe's names are the checkpoint's (no prefix).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...spec.probe import random_probe_model
from ..common.probe import TINY_WIDTHS

# Gated delta net and rotary widths: head_dim 16 with the release's partial_rotary_factor 0.25 rotates 4 dims,
# which the text-only M-RoPE splits [2, 1, 1] over (t, h, w).
LINEAR_WIDTHS = {"linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 1,
                 "linear_num_value_heads": 2, "mtp_num_hidden_layers": 0}
VISION_WIDTHS = {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2,
                 "num_position_embeddings": 16}


def tiny_config(config: Any) -> Any:
    """A fresh config of the same class: tiny text, linear-attention and vision widths, token ids in the vocab."""
    raw = config.to_dict()
    text = {k: v for k, v in raw["text_config"].items() if k != "quantization_config"}
    text.update({k: v for k, v in {**TINY_WIDTHS, **LINEAR_WIDTHS}.items() if k in text})
    rope = dict(text.get("rope_parameters") or {})
    if "mrope_section" in rope:
        rope["mrope_section"] = [2, 1, 1]
    text["rope_parameters"] = rope
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(text.get(token), int):
            text[token] = text["vocab_size"] - 1
    vision = {**raw["vision_config"], **VISION_WIDTHS, "out_hidden_size": text["hidden_size"]}
    top = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config", "quantization_config")}
    for token in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        if isinstance(top.get(token), int):
            top[token] = text["vocab_size"] - 2
    tiny = type(config)(**top, text_config=text, vision_config=vision)
    tiny._experts_implementation = "eager"
    tiny.text_config._experts_implementation = "eager"
    return tiny


def probe_model(model_cls: type, config: Any, device: torch.device) -> tuple[nn.Module, str]:
    """``QuantSpec.probe_model``: (the tiny VLM in fp32 on ``device``, small random weights; no name prefix)."""
    return random_probe_model(lambda: model_cls(tiny_config(config)), device), ""
