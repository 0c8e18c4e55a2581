"""Generator for a tiny GLM-5 stand-in (``glm_moe_dsa``: MLA attention with the DSA sparse-attention indexer,
DeepSeek-style MoE, one MTP layer) from transformers' own ``GlmMoeDsa*`` classes (no remote code).

Laid out as zai-org/GLM-5 is on the hub: BF16, ``model.layers.{i}`` with the first ``first_k_dense_replace``
layers dense, the routed experts one Linear per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``; fused
by transformers' ``qwen2_moe`` conversion as it loads), the router ``mlp.gate.weight`` with its fp32
``mlp.gate.e_score_correction_bias``, the indexer under ``self_attn.indexer.{wq_b,wk,k_norm,weights_proj}``,
and the MTP layer stored as decoder layer ``model.layers.{num_hidden_layers}`` plus DeepSeek-V3's MTP
extras less the two GLM-5 does not store (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``; no layer-local
``embed_tokens`` / ``shared_head.head``: the MTP layer shares the model's). transformers has
no MTP module; it ignores only ``model.layers.78.*`` (GLM-5's own index, hard-coded), so on this stand-in the
MTP tensors are its only unexpected keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..models.deepseek_v3.source_layout import MTP_EXTRAS
from .hub_standin import bf16_tensors, hub_shapes, meta_model, per_expert
from .tiny import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, fresh_dir, write_stand_in
from .tokenizer import calibration_token_ids as calibration_token_ids

# GLM-5's MTP layer has no own embedding or output head (it reuses the model's): DeepSeek-V3's extras less those.
GLM_MTP_EXTRAS = {k: v for k, v in MTP_EXTRAS.items() if k not in ("embed_tokens.weight", "shared_head.head.weight")}

# Every dim a multiple of 16 (NVFP4 block); layer 0 dense, 1-2 MoE; index_topk below the test's sequence
# length so the indexer's selection matters.
GLM_MOE_DSA_TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "index_topk": 4,
    "index_head_dim": 32,
    "index_n_heads": 2,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "num_nextn_predict_layers": 1,
}

# The released sizes, for the planner's header-only layout: zai-org/GLM-5's config.json (BF16; the values
# transformers 5.25's ``GlmMoeDsaConfig`` defaults to, and xLLM's ``glm5.h`` quotes from the hub config): 78 layers,
# the first 3 dense (intermediate 12288), 256 routed experts top-8 of 2048 and one shared expert, hidden 6144, MLA
# with 64 heads (q_lora 2048, kv_lora 512, qk 192 + 64, v 256), the DSA indexer (32 heads of 128, top-2048),
# vocab 154880, one MTP layer (``model.layers.78``): 743.9B parameters besides the MTP layer (the release's
# "744B"), 10.0B in it. zai-org/GLM-5-FP8, the block-FP8 variant, is not modelled here.
GLM5_SIZES: dict[str, Any] = {
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "first_k_dense_replace": 3,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "num_nextn_predict_layers": 1,
}

# GLM-5.1/5.2's IndexCache schedule (off by default, as GLM-5 runs every layer's indexer): with
# ``index_topk_freq`` f > 1 only every f-th layer from ``index_skip_topk_offset`` on has an indexer ("full"),
# the others ("shared") reuse its top-k and store no indexer tensors. Written to config.json only when given.
GLM_MOE_DSA_OPTIONAL = ("index_topk_freq", "index_skip_topk_offset")

_EXPERT_PROJS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def checkpoint_config(s: dict[str, Any]) -> dict[str, Any]:
    """config.json for sizes ``s``, spelled as GLM-5's."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        **s,
        "hidden_act": "silu",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "attention_bias": False,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "torch_dtype": "bfloat16",
    }


def _model(config: dict[str, Any], num_layers: int) -> Any:
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    return meta_model(GlmMoeDsaForCausalLM, GlmMoeDsaConfig(**{**cfg, "num_hidden_layers": num_layers}))


def hub_layout(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """transformers' GLM-MoE-DSA tensor -> the hub's tensors holding it (only the experts differ)."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return per_expert(name, shape, _EXPERT_PROJS)
    return [(name, shape)]


def mtp_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The MTP layers' hub tensors: decoder layer ``model.layers.{L + j}`` as a model one layer deeper builds
    it (MoE, with its indexer), then ``GLM_MTP_EXTRAS``."""
    first, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    out: list[tuple[str, tuple[int, ...]]] = []
    for layer in range(first, first + config["num_nextn_predict_layers"]):
        prefix = f"model.layers.{layer}."
        out += [(n, s) for n, s in hub_shapes(_model(config, layer + 1), hub_layout) if n.startswith(prefix)]
        out += [(prefix + extra, shape(hidden, vocab)) for extra, shape in GLM_MTP_EXTRAS.items()]
    return out


def _resolve_sizes(sizes: dict[str, Any]) -> dict[str, Any]:
    unknown = set(sizes) - set(GLM_MOE_DSA_TINY_DEFAULTS) - set(GLM_MOE_DSA_OPTIONAL)
    if unknown:
        raise ValueError(f"unknown tiny GLM-MoE-DSA setting(s) {sorted(unknown)}; known: {sorted(GLM_MOE_DSA_TINY_DEFAULTS)}")
    s = {**GLM_MOE_DSA_TINY_DEFAULTS, **sizes}
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank"):
        if s[key] % 16:
            raise ValueError(f"{key}={s[key]} must be a multiple of 16 (the NVFP4 block)")
    return s


def make_tiny_glm_moe_dsa(
    path: str | Path, *, seed: int = 0, overwrite: bool = False, max_shard_size: int | None = None, **sizes: Any
) -> Path:
    """Write a tiny GLM-5 checkpoint into ``path`` and return it (``sizes`` override
    ``GLM_MOE_DSA_TINY_DEFAULTS``). Same arguments, byte-identical files."""
    s = _resolve_sizes(sizes)
    path = fresh_dir(path, overwrite)
    config = checkpoint_config(s)
    shapes = hub_shapes(_model(config, s["num_hidden_layers"]), hub_layout) + mtp_shapes(config)
    tensors = list(bf16_tensors(shapes, seed, fp32=lambda n: n.endswith("e_score_correction_bias")))
    return write_stand_in(path, tensors, config, vocab_size=s["vocab_size"], max_shard_size=max_shard_size)


def make_glm5_layout(path: str | Path, *, sizes: dict[str, Any] | None = None, sparse: bool = True,
                     overwrite: bool = False, shard_bytes: int = 5 * 10**9) -> Path:
    """A full-size GLM-5 checkpoint without the bytes (``testing/header_only.py``'s files; ``sizes`` override
    ``GLM5_SIZES``): the stand-in's names and shapes, MTP layer included, BF16 but the routers' F32 bias, each
    shard sparse (the right size, no data blocks) or, ``sparse=False``, its header alone; about 1.5 TB apparent.
    No tokenizer: the planners' input."""
    from .header_only import write_layout

    s = _resolve_sizes({**GLM5_SIZES, **(sizes or {})})
    path = fresh_dir(path, overwrite)
    config = checkpoint_config(s)
    shapes = hub_shapes(_model(config, s["num_hidden_layers"]), hub_layout) + mtp_shapes(config)
    tensors = [(name, torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16, shape)
               for name, shape in shapes]
    write_layout(path, config, tensors, sparse=sparse, shard_bytes=shard_bytes)
    return path
