"""Generator for a tiny Kimi-K2.5 stand-in (transformers' own ``Kimi_K25*`` classes, no remote code).

Laid out as moonshotai/Kimi-K2.5 is on the hub: ``model_type: kimi_k25`` with a DeepSeek-V3 text model
(``text_config.model_type: kimi_k2``, which transformers maps to ``deepseek_v3``) and a MoonViT vision tower;
text tensors under ``language_model.model.layers.{i}`` and ``language_model.lm_head`` (transformers renames
them to ``model.language_model.*`` / ``lm_head`` as it loads: ``conversion_mapping.py`` ``"kimi_k25"``), the
vision tower as the original code names it (``vision_tower.encoder.blocks.{i}.{norm0,norm1,wqkv,wo,mlp.fc0,
mlp.fc1}``, ``vision_tower.patch_embed.pos_emb.weight``) and the projector as ``mm_projector.proj.{0,2}``.
The routed experts are one Linear per expert, INT4 compressed-tensors ``pack-quantized`` (symmetric, group
32: ``weight_packed`` / ``weight_scale`` / ``weight_shape``, the DeepSeek-V3 generator's encoding), every
other weight BF16, the router's ``e_score_correction_bias`` fp32.

transformers' ``save_pretrained`` of this model is not used: it writes the text layers as
``language_model.model.blocks.{i}`` (its vision-only ``blocks -> layers`` rename reversed), which is not
the hub's spelling."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..models.kimi_k25.vision import hub_name
from .deepseek_v3 import _int4_fields, int4_quantization_config
from .hub_standin import bf16_tensors, draw, hub_shapes, meta_model, per_expert
from .tiny import BOS_TOKEN_ID, EOS_TOKEN_ID, MEDIA_TOKEN_ID, PAD_TOKEN_ID, fresh_dir, write_stand_in
from .tokenizer import calibration_token_ids as calibration_token_ids

# Every dim a multiple of 32 (NVFP4 block, INT4 group). Layer 0 dense, layers 1-2 MoE (first_k_dense_replace).
KIMI_K25_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
}
KIMI_K25_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 14,
    "pos_emb_height": 4,
    "pos_emb_width": 4,
}

_EXPERT_PROJS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


# moonshotai/Kimi-K2.5's text quantization_config ``ignore`` list, verbatim (regexes over module names).
HUB_INT4_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]


def _vision_config(v: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """The hub's MoonViT keys (``vt_*``, ``init_pos_emb_*``, read by the remote code and vLLM's
    ``KimiK25VisionConfig``) AND transformers' field names for the same sizes: transformers 5.25's
    ``Kimi_K25VisionConfig`` reads neither ``vt_*`` nor ``init_pos_emb_*`` and would build its (real-size)
    defaults, so a tiny stand-in spelled only as the hub does would not load in transformers."""
    hub = {
        "patch_size": v["patch_size"],
        "init_pos_emb_height": v["pos_emb_height"],
        "init_pos_emb_width": v["pos_emb_width"],
        "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed",
        "vt_hidden_size": v["hidden_size"],
        "vt_intermediate_size": v["intermediate_size"],
        "vt_num_attention_heads": v["num_attention_heads"],
        "vt_num_hidden_layers": v["num_hidden_layers"],
        "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool",
        "video_attn_type": "spatial_temporal",
        "mm_projector_type": "patchmerger",
        "mm_hidden_size": v["hidden_size"],
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
        "text_hidden_size": text_hidden,
    }
    return {**hub, **v, "pos_emb_time": 4}


def checkpoint_config(text: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
    """config.json for sizes ``text`` / ``vision``, nested and spelled as Kimi-K2.5's (no quantization_config;
    the real one carries it at the top and in ``text_config``)."""
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "kimi_k2",
            **text,
            "hidden_act": "silu",
            "moe_layer_freq": 1,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "seq_aux": True,
            "aux_loss_alpha": 0.001,
            "ep_size": 1,
            "routed_scaling_factor": 2.827,
            "norm_topk_prob": True,
            "num_nextn_predict_layers": 0,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096,
            "rope_theta": 50000.0,
            "tie_word_embeddings": False,
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            "pad_token_id": PAD_TOKEN_ID,
            "dtype": "bfloat16",
        },
        "vision_config": _vision_config(vision, text["hidden_size"]),
        # The hub's media token (remote code, vLLM) and transformers' name for it.
        "media_placeholder_token_id": MEDIA_TOKEN_ID,
        "image_token_id": MEDIA_TOKEN_ID,
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "ignore_index": -100,
        "projection_hidden_size": vision["hidden_size"],
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def _transformers_config(config: dict[str, Any]) -> Any:
    from transformers import Kimi_K25Config

    cfg = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "quantization_config")}
    return Kimi_K25Config(**cfg)


def hub_layout(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """transformers' Kimi-K2.5 tensor -> the hub's tensors holding it."""
    if name.startswith("model.language_model."):
        name = "language_model.model." + name.removeprefix("model.language_model.")
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return per_expert(name, shape, _EXPERT_PROJS)
        return [(name, shape)]
    if name.startswith("lm_head."):
        return [("language_model." + name, shape)]
    return hub_name(name, shape)  # the vision tower and projector (models/kimi_k25/vision.py)


def _is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _checkpoint_tensors(shapes: list[tuple[str, tuple[int, ...]]], seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Routed experts INT4 pack-quantized, score-correction biases fp32, the rest BF16."""
    for name, shape in shapes:
        if _is_routed_expert(name):
            head = name.removesuffix(".weight")
            yield from ((f"{head}.{k}", t) for k, t in _int4_fields(draw(name, shape, seed).bfloat16()).items())
        else:
            yield from bf16_tensors([(name, shape)], seed, fp32=lambda n: n.endswith("e_score_correction_bias"))


def _resolve(sizes: dict[str, Any], defaults: dict[str, Any], what: str) -> dict[str, Any]:
    unknown = set(sizes) - set(defaults)
    if unknown:
        raise ValueError(f"unknown tiny Kimi-K2.5 {what} setting(s) {sorted(unknown)}; known: {sorted(defaults)}")
    return {**defaults, **sizes}


def make_tiny_kimi_k25(
    path: str | Path, *, seed: int = 0, overwrite: bool = False, max_shard_size: int | None = None,
    text: dict[str, Any] | None = None, vision: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny Kimi-K2.5 checkpoint into ``path`` and return it (``text`` / ``vision`` override
    ``KIMI_K25_TEXT_DEFAULTS`` / ``KIMI_K25_VISION_DEFAULTS``). Same arguments, byte-identical files."""
    s_text = _resolve(text or {}, KIMI_K25_TEXT_DEFAULTS, "text")
    s_vision = _resolve(vision or {}, KIMI_K25_VISION_DEFAULTS, "vision")
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank"):
        if s_text[key] % 32:
            raise ValueError(f"{key}={s_text[key]} must be a multiple of 32 (the NVFP4 block and the INT4 group)")
    path = fresh_dir(path, overwrite)
    config = checkpoint_config(s_text, s_vision)
    from transformers import Kimi_K25ForConditionalGeneration

    shapes = hub_shapes(meta_model(Kimi_K25ForConditionalGeneration, _transformers_config(config)), hub_layout)
    quantization = int4_quantization_config(HUB_INT4_IGNORE)
    config["quantization_config"] = quantization
    config["text_config"]["quantization_config"] = quantization
    tensors = list(_checkpoint_tensors(shapes, seed))
    return write_stand_in(path, tensors, config, vocab_size=s_text["vocab_size"], max_shard_size=max_shard_size)
