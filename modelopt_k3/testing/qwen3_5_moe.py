"""Generator for a tiny Qwen3.5-MoE stand-in, the VLM as released (``Qwen3_5MoeForConditionalGeneration``:
gated-delta-net / gated-attention hybrid text model, MoE with a gated shared expert, vision tower and merger,
one MTP layer), from transformers' own ``Qwen3_5Moe*`` classes (no remote code).

Laid out as Qwen/Qwen3.5-35B-A3B and Qwen3.5-397B-A17B are on the hub: BF16, ``model.language_model.layers.{i}``
with ``linear_attn.*`` (gated delta net) or ``self_attn.*`` layers as ``text_config.layer_types`` says, the
routed experts already FUSED as transformers holds them (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, gate rows
first, and ``mlp.experts.down_proj`` ``[E, H, I]``), the vision tower under ``model.visual.*``, ``lm_head``
at the top, and the MTP block under ``mtp.`` (``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``,
``norm`` and one full-attention MoE layer ``mtp.layers.0`` whose experts are stored one Linear per expert).
transformers has no MTP module and drops ``mtp.*`` on load (``_keys_to_ignore_on_load_unexpected``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .hub_standin import draw, hub_shapes, meta_model, per_expert
from .tiny import BOS_TOKEN_ID, EOS_TOKEN_ID, MEDIA_TOKEN_ID, PAD_TOKEN_ID, fresh_dir, write_stand_in
from .tokenizer import calibration_token_ids as calibration_token_ids

# Three gated-delta-net layers then one full-attention layer (the real interval is 4); every dim a multiple
# of 16 (NVFP4 block).
QWEN3_5_MOE_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "mtp_num_hidden_layers": 1,
}
QWEN3_5_MOE_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 64,
}

# The released sizes, for header-only layouts (the planner): Qwen3.5-35B-A3B / Qwen3.6-35B-A3B are transformers'
# own Qwen3_5MoeConfig defaults (= decisions/0007's 35B facts); Qwen3.5-397B-A17B from NVIDIA's model card as 0007
# quotes it (60 layers, hidden 4096, 512 experts top-10, expert 1024, GDN 64 value / 16 QK heads of 128, attention
# 32 / 2 heads of 256), its shared expert taken as wide as one routed expert (not in the card: an assumption).
QWEN3_5_35B_TEXT: dict[str, Any] = {
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "full_attention_interval": 4,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts": 256,
    "num_experts_per_tok": 8, "mtp_num_hidden_layers": 1,
}
QWEN3_5_397B_TEXT: dict[str, Any] = {
    **QWEN3_5_35B_TEXT, "hidden_size": 4096, "num_hidden_layers": 60, "num_attention_heads": 32,
    "linear_num_value_heads": 64, "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
    "num_experts": 512, "num_experts_per_tok": 10,
}
# transformers' Qwen3_5MoeVisionConfig defaults (the released vision tower).
QWEN3_5_VISION: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
    "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 2304,
}

_EXPERT_PROJS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _layer_types(s: dict[str, Any]) -> list[str]:
    interval = s["full_attention_interval"]
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(s["num_hidden_layers"])]


def checkpoint_config(text: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
    """config.json for sizes ``text`` / ``vision``, nested and spelled as Qwen3.5-MoE's."""
    text_fields = {k: v for k, v in text.items() if k != "full_attention_interval"}
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            **text_fields,
            "layer_types": _layer_types(text),
            "full_attention_interval": text["full_attention_interval"],
            "hidden_act": "silu",
            "linear_conv_kernel_dim": 4,
            "attention_bias": False,
            "attn_output_gate": True,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_interleaved": True, "mrope_section": [2, 1, 1]},
            "router_aux_loss_coef": 0.001,
            "tie_word_embeddings": False,
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            "pad_token_id": PAD_TOKEN_ID,
            "dtype": "bfloat16",
        },
        "vision_config": {
            "model_type": "qwen3_5_moe_vision",
            **vision,
            "in_channels": 3,
            "hidden_act": "gelu_pytorch_tanh",
            "out_hidden_size": text["hidden_size"],
        },
        "image_token_id": MEDIA_TOKEN_ID,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def _model(config: dict[str, Any]) -> Any:
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    cfg = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    return meta_model(Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeConfig(**cfg))


def hub_layout(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """transformers' Qwen3.5-MoE tensor -> the hub's: the same name and shape (the hub stores the experts fused)."""
    return [(name, shape)]


def mtp_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The MTP block's hub tensors: the fusion (two norms, ``fc`` over [embedding; hidden]), one full-attention
    MoE decoder layer per ``mtp_num_hidden_layers`` as ``mtp.layers.{j}`` (experts per expert), the final norm."""
    text = config["text_config"]
    hidden, depth = text["hidden_size"], text["mtp_num_hidden_layers"]
    one_layer = {**config, "text_config": {**text, "num_hidden_layers": 1, "layer_types": ["full_attention"]}}
    prefix = "model.language_model.layers.0."
    layer = [(n.removeprefix(prefix), s) for n, s in hub_shapes(_model(one_layer), hub_layout) if n.startswith(prefix)]
    out = [("mtp.fc.weight", (hidden, 2 * hidden)), ("mtp.pre_fc_norm_embedding.weight", (hidden,)),
           ("mtp.pre_fc_norm_hidden.weight", (hidden,))]
    for j in range(depth):
        for name, shape in layer:
            full = f"mtp.layers.{j}.{name}"
            out += per_expert(full, shape, _EXPERT_PROJS) if name.startswith("mlp.experts.") else [(full, shape)]
    return out + [("mtp.norm.weight", (hidden,))]


def _zero_centered(name: str) -> bool:
    """Qwen3.5's text RMSNorms scale by ``1 + weight`` (trained weights sit near 0); the gated-delta-net output
    norm and the vision tower's LayerNorms scale by ``weight`` as usual."""
    return (name.startswith(("model.language_model.", "mtp.")) and name.endswith("norm.weight")
            and not name.endswith("linear_attn.norm.weight"))


def _checkpoint_tensors(shapes: list[tuple[str, tuple[int, ...]]], seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """BF16 throughout; zero-centered norms drawn near 0 rather than near 1."""
    for name, shape in shapes:
        value = draw(name, shape, seed)
        yield name, (value - 1.0 if _zero_centered(name) else value).to(torch.bfloat16)


def _resolve(sizes: dict[str, Any], defaults: dict[str, Any], what: str) -> dict[str, Any]:
    unknown = set(sizes) - set(defaults)
    if unknown:
        raise ValueError(f"unknown tiny Qwen3.5-MoE {what} setting(s) {sorted(unknown)}; known: {sorted(defaults)}")
    return {**defaults, **sizes}


def make_tiny_qwen3_5_moe(
    path: str | Path, *, seed: int = 0, overwrite: bool = False, max_shard_size: int | None = None,
    text: dict[str, Any] | None = None, vision: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny Qwen3.5-MoE (VLM) checkpoint into ``path`` and return it (``text`` / ``vision`` override
    ``QWEN3_5_MOE_TEXT_DEFAULTS`` / ``QWEN3_5_MOE_VISION_DEFAULTS``). Same arguments, byte-identical files."""
    s_text = _resolve(text or {}, QWEN3_5_MOE_TEXT_DEFAULTS, "text")
    s_vision = _resolve(vision or {}, QWEN3_5_MOE_VISION_DEFAULTS, "vision")
    for key in ("hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if s_text[key] % 16:
            raise ValueError(f"{key}={s_text[key]} must be a multiple of 16 (the NVFP4 block)")
    path = fresh_dir(path, overwrite)
    config = checkpoint_config(s_text, s_vision)
    shapes = hub_shapes(_model(config), hub_layout)
    if s_text["mtp_num_hidden_layers"]:
        shapes += mtp_shapes(config)
    tensors = list(_checkpoint_tensors(shapes, seed))
    return write_stand_in(path, tensors, config, vocab_size=s_text["vocab_size"], max_shard_size=max_shard_size)


def make_qwen3_5_moe_layout(path: str | Path, text: dict[str, Any] | None = None, *, sparse: bool = True,
                            overwrite: bool = False, shard_bytes: int = 5 * 2**30) -> Path:
    """A full-size Qwen3.5-MoE checkpoint layout without the bytes (``testing/header_only.py``'s files): the names
    and shapes the tiny generator writes, at ``text`` sizes (default ``QWEN3_5_397B_TEXT``) with the released
    vision tower, BF16, each shard a sparse file (``sparse=True``: the right size, no blocks, zeros) or its header
    alone (``sparse=False``)."""
    from .header_only import write_layout

    path = fresh_dir(path, overwrite)
    config = checkpoint_config(text or QWEN3_5_397B_TEXT, QWEN3_5_VISION)
    shapes = hub_shapes(_model(config), hub_layout) + mtp_shapes(config)
    write_layout(path, config, [(name, torch.bfloat16, shape) for name, shape in shapes], sparse=sparse,
                 shard_bytes=shard_bytes)
    return path
