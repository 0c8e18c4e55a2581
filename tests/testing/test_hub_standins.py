"""The tiny stand-ins of Kimi-K2.5, Nemotron-H, GLM-5, Qwen3.5-MoE and MiniMax-M2: byte-reproducible, stored
under the real hub checkpoints' tensor names, and loaded by transformers' own model classes (every tensor,
no missing or mismatched keys; Mamba-2 and gated-delta-net through transformers' PyTorch fallbacks on CPU)
with finite logits."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from _standins import dequantized_copy, stored, stored_names

from modelopt_k3.testing import glm_moe_dsa, kimi_k25, minimax_m2, nemotron_h, qwen3_5_moe

N = r"\d+"  # a layer, block or expert index

# Kimi-K2.5 (moonshotai/Kimi-K2.5 model.safetensors.index.json; transformers conversion_mapping.py "kimi_k25",
# whose renames start from these names; vLLM kimi_k25.py hf_to_vllm_mapper "language_model.model." prefix).
KIMI_K25_NAMES = [
    r"language_model\.model\.embed_tokens\.weight",
    r"language_model\.model\.norm\.weight",
    r"language_model\.lm_head\.weight",
    rf"language_model\.model\.layers\.{N}\.(input|post_attention)_layernorm\.weight",
    rf"language_model\.model\.layers\.{N}\.self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)\.weight",
    rf"language_model\.model\.layers\.{N}\.self_attn\.(q_a|kv_a)_layernorm\.weight",
    rf"language_model\.model\.layers\.{N}\.mlp\.(gate|up|down)_proj\.weight",
    rf"language_model\.model\.layers\.{N}\.mlp\.shared_experts\.(gate|up|down)_proj\.weight",
    rf"language_model\.model\.layers\.{N}\.mlp\.gate\.(weight|e_score_correction_bias)",
    rf"language_model\.model\.layers\.{N}\.mlp\.experts\.{N}\.(gate|up|down)_proj\.weight_(packed|scale|shape)",
    r"vision_tower\.patch_embed\.proj\.(weight|bias)",
    r"vision_tower\.patch_embed\.pos_emb\.weight",
    rf"vision_tower\.encoder\.blocks\.{N}\.(norm0|norm1|wqkv|wo|mlp\.fc0|mlp\.fc1)\.(weight|bias)",
    r"vision_tower\.encoder\.final_layernorm\.(weight|bias)",
    r"mm_projector\.(pre_norm|proj\.0|proj\.2)\.(weight|bias)",
]
# Nemotron-3 Super (nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16 index; transformers conversion_mapping.py
# "nemotron_h" backbone. -> model. and per-expert up/down; vLLM nemotron_h_mtp.py NemotronHMTP for mtp.layers.*).
NEMOTRON_H_NAMES = [
    r"backbone\.embeddings\.weight",
    r"backbone\.norm_f\.weight",
    r"lm_head\.weight",
    rf"(backbone|mtp)\.layers\.{N}\.norm\.weight",
    rf"backbone\.layers\.{N}\.mixer\.(A_log|D|dt_bias|conv1d\.weight|conv1d\.bias|in_proj\.weight|norm\.weight|out_proj\.weight)",
    rf"(backbone|mtp)\.layers\.{N}\.mixer\.[qkvo]_proj\.weight",
    rf"(backbone|mtp)\.layers\.{N}\.mixer\.gate\.(weight|e_score_correction_bias)",
    rf"(backbone|mtp)\.layers\.{N}\.mixer\.(fc1_latent_proj|fc2_latent_proj)\.weight",
    rf"(backbone|mtp)\.layers\.{N}\.mixer\.shared_experts\.(up|down)_proj\.weight",
    rf"(backbone|mtp)\.layers\.{N}\.mixer\.experts\.{N}\.(up|down)_proj\.weight",
    r"mtp\.layers\.0\.(enorm|hnorm|eh_proj)\.weight",
    rf"mtp\.layers\.{N}\.final_layernorm\.weight",
]
# GLM-5 (zai-org/GLM-5 index; transformers modeling_glm_moe_dsa.py GlmMoeDsaIndexer names, its
# _keys_to_ignore_on_load_unexpected "model.layers.78" = the MTP layer; third-party GLM-5 MTP loaders: layer 78
# holds enorm/hnorm/eh_proj/shared_head.norm but no embed_tokens/shared_head.head, tied to the model's).
GLM_MOE_DSA_NAMES = [
    r"model\.embed_tokens\.weight",
    r"model\.norm\.weight",
    r"lm_head\.weight",
    rf"model\.layers\.{N}\.(input|post_attention)_layernorm\.weight",
    rf"model\.layers\.{N}\.self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)\.weight",
    rf"model\.layers\.{N}\.self_attn\.(q_a|kv_a)_layernorm\.weight",
    rf"model\.layers\.{N}\.self_attn\.indexer\.(wq_b\.weight|wk\.weight|k_norm\.weight|k_norm\.bias|weights_proj\.weight)",
    rf"model\.layers\.{N}\.mlp\.(shared_experts\.)?(gate|up|down)_proj\.weight",
    rf"model\.layers\.{N}\.mlp\.gate\.(weight|e_score_correction_bias)",
    rf"model\.layers\.{N}\.mlp\.experts\.{N}\.(gate|up|down)_proj\.weight",
    rf"model\.layers\.{N}\.(enorm|hnorm|eh_proj|shared_head\.norm)\.weight",
]
# Qwen3.5-MoE (Qwen/Qwen3.5-35B-A3B index: fused experts in the decoder, per-expert in mtp.layers; vLLM
# qwen3_5.py load_weights' fused-expert path "qwen3.5 no need to transpose" and its skip of "mtp.").
QWEN3_5_MOE_NAMES = [
    r"model\.language_model\.embed_tokens\.weight",
    r"model\.language_model\.norm\.weight",
    r"lm_head\.weight",
    rf"(model\.language_model|mtp)\.layers\.{N}\.(input|post_attention)_layernorm\.weight",
    rf"model\.language_model\.layers\.{N}\.linear_attn\.(A_log|dt_bias|conv1d\.weight|norm\.weight|out_proj\.weight|in_proj_(qkv|z|a|b)\.weight)",
    rf"(model\.language_model|mtp)\.layers\.{N}\.self_attn\.([qkvo]_proj|q_norm|k_norm)\.weight",
    rf"(model\.language_model|mtp)\.layers\.{N}\.mlp\.(gate|shared_expert_gate)\.weight",
    rf"(model\.language_model|mtp)\.layers\.{N}\.mlp\.shared_expert\.(gate|up|down)_proj\.weight",
    rf"model\.language_model\.layers\.{N}\.mlp\.experts\.(gate_up_proj|down_proj)",
    rf"mtp\.layers\.{N}\.mlp\.experts\.{N}\.(gate|up|down)_proj\.weight",
    r"mtp\.(fc|norm|pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight",
    r"model\.visual\.patch_embed\.proj\.(weight|bias)",
    r"model\.visual\.pos_embed\.weight",
    rf"model\.visual\.blocks\.{N}\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.linear_fc1|mlp\.linear_fc2)\.(weight|bias)",
    r"model\.visual\.merger\.(norm|linear_fc1|linear_fc2)\.(weight|bias)",
]
# MiniMax-M2 (MiniMaxAI/MiniMax-M2 index; transformers conversion_mapping.py "minimax_m2" = mixtral's
# block_sparse_moe / w1 w3 w2 plus its e_score_correction_bias rename; config modules_to_not_convert).
MINIMAX_M2_NAMES = [
    r"model\.embed_tokens\.weight",
    r"model\.norm\.weight",
    r"lm_head\.weight",
    rf"model\.layers\.{N}\.(input|post_attention)_layernorm\.weight",
    rf"model\.layers\.{N}\.self_attn\.[qkvo]_proj\.weight(_scale_inv)?",
    rf"model\.layers\.{N}\.self_attn\.(q_norm|k_norm)\.weight",
    rf"model\.layers\.{N}\.block_sparse_moe\.gate\.weight",
    rf"model\.layers\.{N}\.block_sparse_moe\.e_score_correction_bias",
    rf"model\.layers\.{N}\.block_sparse_moe\.experts\.{N}\.w[123]\.weight(_scale_inv)?",
]


@dataclass(frozen=True)
class StandIn:
    make: Callable[..., Path]
    layout: Callable[[str, tuple[int, ...]], list[tuple[str, tuple[int, ...]]]]
    model_class: str
    names: list[str]
    # Stored keys transformers' model has no module for (the MTP layers it does not build).
    unexpected: Callable[[str], bool] = field(default=lambda key: False)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    # transformers tensors not stored 1:1 or as stacked experts (Kimi's vision q/k/v: chunks of a rope-permuted wqkv).
    reshaped: str = r"$^"


_GLM_MTP = f"model.layers.{glm_moe_dsa.GLM_MOE_DSA_TINY_DEFAULTS['num_hidden_layers']}."
STAND_INS = {
    "kimi_k25": StandIn(kimi_k25.make_tiny_kimi_k25, kimi_k25.hub_layout, "Kimi_K25ForConditionalGeneration", KIMI_K25_NAMES,
                        dtypes={"weight_packed": torch.int32, "e_score_correction_bias": torch.float32},
                        reshaped=r"model\.vision_tower\.layers\.\d+\.attn\.[qkv]_proj\.(weight|bias)"),
    "nemotron_h": StandIn(nemotron_h.make_tiny_nemotron_h, nemotron_h.hub_layout, "NemotronHForCausalLM", NEMOTRON_H_NAMES,
                          dtypes={"experts.0.up_proj.weight": torch.bfloat16}),
    "glm_moe_dsa": StandIn(glm_moe_dsa.make_tiny_glm_moe_dsa, glm_moe_dsa.hub_layout, "GlmMoeDsaForCausalLM", GLM_MOE_DSA_NAMES,
                           unexpected=lambda key: key.startswith(_GLM_MTP),
                           dtypes={"e_score_correction_bias": torch.float32}),
    "qwen3_5_moe": StandIn(qwen3_5_moe.make_tiny_qwen3_5_moe, qwen3_5_moe.hub_layout, "Qwen3_5MoeForConditionalGeneration", QWEN3_5_MOE_NAMES,
                           dtypes={"experts.gate_up_proj": torch.bfloat16}),
    "minimax_m2": StandIn(minimax_m2.make_tiny_minimax_m2, minimax_m2.hub_layout, "MiniMaxM2ForCausalLM", MINIMAX_M2_NAMES,
                          dtypes={"w1.weight": torch.float8_e4m3fn, "gate.weight": torch.float32}),
}


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(STAND_INS))
def stand_in(request, tmp_path_factory) -> tuple[str, StandIn, Path]:
    spec = STAND_INS[request.param]
    return request.param, spec, spec.make(tmp_path_factory.mktemp(request.param) / "ckpt", seed=0)


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_same_call_same_bytes_other_seed_other_bytes(stand_in, tmp_path):
    model_type, spec, ckpt = stand_in
    again = spec.make(tmp_path / "again", seed=0)
    assert _digests(again) == _digests(ckpt)
    other = _digests(spec.make(tmp_path / "other", seed=1))
    shards = [n for n in other if n.endswith(".safetensors")]
    assert len(shards) >= 2 and all(other[n] != _digests(ckpt)[n] for n in shards)
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == model_type


def test_tensor_names_are_the_hub_checkpoints(stand_in):
    """Every stored name matches one of the real checkpoint's name patterns, and every pattern is used."""
    _, spec, ckpt = stand_in
    names = stored_names(ckpt)
    patterns = [re.compile(p) for p in spec.names]
    assert [n for n in names if not any(p.fullmatch(n) for p in patterns)] == []
    assert [p.pattern for p in patterns if not any(p.fullmatch(n) for n in names)] == []
    tensors = stored(ckpt)
    for suffix, dtype in spec.dtypes.items():
        hits = [k for k in tensors if k.endswith(suffix)]
        assert hits and all(tensors[k].dtype == dtype for k in hits), suffix


def test_transformers_loads_every_tensor_and_gives_finite_logits(stand_in, tmp_path):
    import transformers

    _, spec, ckpt = stand_in
    source = dequantized_copy(ckpt, tmp_path / "bf16")
    model, info = getattr(transformers, spec.model_class).from_pretrained(
        str(source), dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] == set() and info["mismatched_keys"] == set()
    assert info["error_msgs"] == []
    assert info["unexpected_keys"] and all(map(spec.unexpected, info["unexpected_keys"])) \
        if any(map(spec.unexpected, stored_names(ckpt))) else info["unexpected_keys"] == set()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[256, 3, 70, 101, 9, 44, 200, 17, 5, 88]])).logits
    assert logits.shape == (1, 10, model.config.get_text_config().vocab_size)
    assert logits.isfinite().all() and logits.std() > 0


def _from_hub(names: list[tuple[str, tuple[int, ...]]], source: dict[str, torch.Tensor], shape: tuple[int, ...]):
    """The tensor transformers should hold, rebuilt from the hub tensors ``names`` (per-expert Linears stacked
    over the experts, gate before up), or None where transformers reshapes it (the permuted vision wqkv)."""
    if len(names) == 1:
        name, hub_shape = names[0]
        return source[name] if hub_shape == shape else None
    per = len(names) // shape[0]
    return torch.stack([torch.cat([source[n] for n, _ in names[e * per:(e + 1) * per]]) for e in range(shape[0])])


def test_every_loaded_tensor_is_the_stored_one(stand_in, tmp_path):
    """transformers' loaded parameters equal the stored (decoded) tensors the layout names for them: the names
    are not only accepted but land where the hub's do (a gate/up or vision-norm swap would fail here)."""
    import transformers

    _, spec, ckpt = stand_in
    source_dir = dequantized_copy(ckpt, tmp_path / "bf16")
    source = stored(source_dir)
    model = getattr(transformers, spec.model_class).from_pretrained(str(source_dir), dtype=torch.float32)
    unchecked = []
    for name, value in model.state_dict().items():
        hub = spec.layout(name, tuple(value.shape))
        expected = _from_hub(hub, source, tuple(value.shape)) if hub and hub[0][0] in source else None
        if expected is None:
            unchecked.append(name)
        else:
            assert torch.equal(value, expected.float()), name
    assert [n for n in unchecked if not re.fullmatch(spec.reshaped, n)] == []


def test_glm_shared_indexer_layers_store_no_indexer(tmp_path):
    """GLM-5.1-style IndexCache (``index_topk_freq`` 2): "shared" layers hold no indexer tensors, and transformers
    still loads every tensor it has, the MTP layer aside."""
    import transformers

    ckpt = glm_moe_dsa.make_tiny_glm_moe_dsa(tmp_path / "ckpt", num_hidden_layers=4, index_topk_freq=2,
                                             index_skip_topk_offset=1)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["index_topk_freq"] == 2
    with_indexer = {int(n.split(".")[2]) for n in stored_names(ckpt) if ".self_attn.indexer." in n}
    assert with_indexer == {0, 2, 4}  # full layers 0 and 2 (offset 1, every 2nd), and the MTP layer 4
    _, info = transformers.GlmMoeDsaForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32,
                                                                output_loading_info=True)
    assert info["missing_keys"] == set() and all(k.startswith("model.layers.4.") for k in info["unexpected_keys"])
