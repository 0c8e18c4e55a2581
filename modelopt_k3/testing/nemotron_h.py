"""Generator for a tiny Nemotron-H stand-in, the latent-MoE variant (Nemotron-3 Super/Ultra), from
transformers' own ``NemotronH*`` classes (no remote code).

Laid out as nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16 is on the hub: ``model_type: nemotron_h`` with the
layer kinds in ``hybrid_override_pattern`` (``M`` Mamba-2, ``*`` attention, ``E`` latent MoE) and the MTP
block in ``mtp_hybrid_override_pattern``; tensors under ``backbone.`` (``backbone.embeddings``,
``backbone.layers.{i}.{norm,mixer}``, ``backbone.norm_f``; transformers renames ``backbone.`` to ``model.``:
``conversion_mapping.py`` ``"nemotron_h"``), the routed experts one non-gated relu2 Linear pair per expert
(``mixer.experts.{e}.{up,down}_proj.weight``, working in the latent space between ``mixer.fc1_latent_proj``
and ``mixer.fc2_latent_proj``), BF16 throughout, the router's ``e_score_correction_bias`` fp32. The MTP layers
are stored as ``mtp.layers.{j}`` (the first with ``enorm`` / ``hnorm`` / ``eh_proj``, the last with
``final_layernorm``: vLLM's ``nemotron_h_mtp.py``); transformers' model has no MTP module and drops them on
load (its ``_keys_to_ignore_on_load_unexpected = ["mtp.*"]``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .hub_standin import bf16_tensors, hub_shapes, meta_model, per_expert
from .tiny import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, fresh_dir, write_stand_in
from .tokenizer import calibration_token_ids as calibration_token_ids

# Every layer kind of the real pattern (Mamba-2, latent MoE, attention), MTP = attention + MoE as Super's.
NEMOTRON_H_TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "hybrid_override_pattern": "ME*E",
    "mtp_hybrid_override_pattern": "*E",
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "n_groups": 2,
    "ssm_state_size": 16,
    "chunk_size": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 64,
    "moe_latent_size": 32,
}

_EXPERT_PROJS = {"up_proj": ("up_proj",), "down_proj": ("down_proj",)}


def checkpoint_config(s: dict[str, Any]) -> dict[str, Any]:
    """config.json for sizes ``s``, spelled as Nemotron-3 Super's (pattern strings, not layer-type lists)."""
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        **s,
        "num_hidden_layers": len(s["hybrid_override_pattern"]),
        "intermediate_size": 4 * s["hidden_size"],
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "conv_kernel": 4,
        "expand": 2,
        "use_conv_bias": True,
        "mamba_proj_bias": False,
        "n_shared_experts": 1,
        "moe_shared_expert_overlap": False,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 5.0,
        "attention_bias": False,
        "mlp_bias": False,
        "use_bias": False,
        "layer_norm_epsilon": 1e-5,
        "residual_in_fp32": False,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "torch_dtype": "bfloat16",
    }


def _model(config: dict[str, Any], pattern: str) -> Any:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "num_hidden_layers")}
    cfg["hybrid_override_pattern"] = pattern
    return meta_model(NemotronHForCausalLM, NemotronHConfig(**cfg))


def hub_layout(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """transformers' Nemotron-H tensor -> the hub's tensors holding it."""
    if name.startswith("model."):
        name = "backbone." + name.removeprefix("model.")
    if name.endswith(("experts.up_proj", "experts.down_proj")):
        return per_expert(name, shape, _EXPERT_PROJS)
    return [(name, shape)]


def mtp_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The MTP block's hub tensors: its pattern's decoder layers as ``mtp.layers.{j}``, the fusion (two norms
    and ``eh_proj`` over [embedding; hidden]) on the first, ``final_layernorm`` on the last."""
    pattern, hidden = config["mtp_hybrid_override_pattern"], config["hidden_size"]
    layers = [(n.replace("backbone.layers.", "mtp.layers.", 1), s)
              for n, s in hub_shapes(_model(config, pattern), hub_layout) if n.startswith("backbone.layers.")]
    first = [("mtp.layers.0.enorm.weight", (hidden,)), ("mtp.layers.0.hnorm.weight", (hidden,)),
             ("mtp.layers.0.eh_proj.weight", (hidden, 2 * hidden))]
    last = [(f"mtp.layers.{len(pattern) - 1}.final_layernorm.weight", (hidden,))]
    return first + layers + last


def _resolve_sizes(sizes: dict[str, Any]) -> dict[str, Any]:
    unknown = set(sizes) - set(NEMOTRON_H_TINY_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown tiny Nemotron-H setting(s) {sorted(unknown)}; known: {sorted(NEMOTRON_H_TINY_DEFAULTS)}")
    s = {**NEMOTRON_H_TINY_DEFAULTS, **sizes}
    for key in ("hidden_size", "moe_intermediate_size", "moe_shared_expert_intermediate_size", "moe_latent_size"):
        if s[key] % 16:
            raise ValueError(f"{key}={s[key]} must be a multiple of 16 (the NVFP4 block)")
    if s["num_nextn_predict_layers"] not in (0, 1):
        raise ValueError("num_nextn_predict_layers must be 0 or 1 (Nemotron-3 has one MTP block)")
    return s


def make_tiny_nemotron_h(
    path: str | Path, *, seed: int = 0, overwrite: bool = False, max_shard_size: int | None = None, **sizes: Any
) -> Path:
    """Write a tiny Nemotron-H (latent MoE, MTP) checkpoint into ``path`` and return it (``sizes`` override
    ``NEMOTRON_H_TINY_DEFAULTS``). Same arguments, byte-identical files."""
    s = _resolve_sizes(sizes)
    path = fresh_dir(path, overwrite)
    config = checkpoint_config(s)
    shapes = hub_shapes(_model(config, s["hybrid_override_pattern"]), hub_layout)
    if s["num_nextn_predict_layers"]:
        shapes += mtp_shapes(config)
    tensors = list(bf16_tensors(shapes, seed, fp32=lambda n: n.endswith("e_score_correction_bias")))
    return write_stand_in(path, tensors, config, vocab_size=s["vocab_size"], max_shard_size=max_shard_size)
