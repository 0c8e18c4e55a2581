"""A full-size Kimi-K3 checkpoint layout without the bytes: real config, real tensor names/shapes/dtypes.

``make_kimi_k3_layout(path)`` writes what ``make_tiny_kimi_k3`` writes (config.json with auto_map and
the MXFP4 ``quantization_config``, remote code, an index, sharded safetensors) at Kimi-K3's sizes
(kimi_k3_reference.md: 93 layers, 896 experts, hidden 7168, moe_intermediate 3072,
routed_expert_hidden_size 3584, the KDA/MLA layer lists, the vision tower), but every shard is a
valid safetensors header over a *sparse* file (``sparse=True``, the default: the right size, no
blocks on disk, every tensor reads as zeros) or the header alone (``sparse=False``: only header
readers such as the memory planner accept it). About 1.5 TB apparent; a few MB on disk.

Names, shapes and dtypes come from the same place as the tiny checkpoint's: the stand-in remote code
built on the meta device (with one routed expert per layer, then replicated to ``num_experts`` keys,
so 82k expert modules are never built) and the tiny generator's dtype rules. ``tests/memory/test_planner.py``
checks that at tiny sizes the layout equals a real tiny checkpoint's headers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..export.writer import header_bytes
from .tiny import (
    _F32_SUFFIXES,
    MXFP4_GROUP,
    REMOTE_CODE_FILES,
    _build_meta_model,
    _ignore_list,
    _is_routed_expert,
    _resolve_sizes,
    _stored_shape,
    checkpoint_config,
    fresh_dir,
    mxfp4_quantization_config,
    remote_code_source,
)
from .tokenizer import make_byte_tokenizer

# kimi_k3_reference.md section 1 (the vision tower at the remote code's defaults: the public dumps
# disagree on vt_hidden_size, 1024 vs 1152; the tower is < 0.1% of the bytes either way).
KIMI_K3_SIZES: dict[str, Any] = {
    "vocab_size": 163840,
    "hidden_size": 7168,
    "num_hidden_layers": 93,
    "intermediate_size": 33792,
    "num_attention_heads": 96,
    "num_key_value_heads": 96,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "kda_layers": [i for i in range(1, 92) if i % 4],
    "full_attn_layers": [*range(4, 93, 4), 93],
    "linear_num_heads": 96,
    "linear_head_dim": 128,
    "short_conv_kernel_size": 4,
    "gate_lower_bound": -5.0,
    "use_full_rank_gate": True,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "moe_intermediate_size": 3072,
    "num_shared_experts": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "routed_expert_hidden_size": 3584,
    "latent_moe_use_norm": True,
    "attn_res_block_size": 12,
    "vt_hidden_size": 1024,
    "vt_num_hidden_layers": 27,
    "vt_num_attention_heads": 12,
    "vt_intermediate_size": 4096,
    "qkv_hidden_size": 1536,
    "mm_hidden_size": 1024,
}
SHARD_BYTES = 5 * 10**9
_EXPERT_KEY = re.compile(r"^(?P<head>.+\.block_sparse_moe\.experts\.)0\.(?P<tail>.+)$")
_ROUTER = re.compile(r"\.block_sparse_moe\.gate\.(weight|e_score_correction_bias)$")


def layout_tensors(sizes: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, torch.dtype, tuple[int, ...]]], list[str]]:
    """(config.json, [(key, dtype, shape)] in checkpoint order, MXFP4 ignore list) for ``sizes``."""
    s = _resolve_sizes(sizes)
    experts = s["num_experts"]
    config = checkpoint_config(s)
    # One routed expert per layer on meta; the router's [E, ...] tensors and the expert keys are widened below.
    meta_cfg = json.loads(json.dumps(config))
    meta_cfg["text_config"]["num_experts"] = 1
    meta_cfg["text_config"]["num_experts_per_token"] = 1
    model, module_types = _build_meta_model(meta_cfg)
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for name, param in model.named_parameters():
        shape = tuple(param.shape)
        if _is_routed_expert(name):
            m = _EXPERT_KEY.match(name)
            out_f, in_f = shape
            prefix = m["tail"][: -len(".weight")]
            for e in range(experts):
                tensors.append((f"{m['head']}{e}.{prefix}.weight_packed", torch.uint8, (out_f, in_f // 2)))
                tensors.append((f"{m['head']}{e}.{prefix}.weight_scale", torch.uint8, (out_f, in_f // MXFP4_GROUP)))
            continue
        if _ROUTER.search(name):
            shape = (experts, *shape[1:])
        shape = _stored_shape(name, shape, s["linear_head_dim"])
        dtype = torch.float32 if name.endswith(_F32_SUFFIXES) else torch.bfloat16
        tensors.append((name, dtype, shape))
    return config, tensors, _ignore_list(module_types)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        n *= d
    return n


def _shards(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], limit: int) -> Iterator[list]:
    shard: list = []
    used = 0
    for t in tensors:
        size = _nbytes(t[1], t[2])
        if shard and used + size > limit:
            yield shard
            shard, used = [], 0
        shard.append(t)
        used += size
    if shard:
        yield shard


def _write_shard(path: Path, shard: list, sparse: bool) -> int:
    header, _ = header_bytes({"format": "pt"}, ((name, dt, shape, _nbytes(dt, shape)) for name, dt, shape in shard))
    offset = sum(_nbytes(dtype, shape) for _, dtype, shape in shard)
    with open(path, "wb") as f:
        f.write(header)
        if sparse:
            f.truncate(len(header) + offset)  # a hole: the size is right, no data block is allocated
    return offset


def write_layout(path: Path, config: dict, tensors, *, sparse: bool, shard_bytes: int) -> None:
    """``tensors`` (name, dtype, shape) cut into shards of about ``shard_bytes``, each written header-only or
    sparse, with the index and ``config.json``: the files every full-size layout writes."""
    shards = list(_shards(tensors, shard_bytes))
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += _write_shard(path / fname, shard, sparse)
        weight_map.update(dict.fromkeys((name for name, _, _ in shard), fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, separators=(",", ":")))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_kimi_k3_layout(
    path: str | Path, *, sizes: dict[str, Any] | None = None, sparse: bool = True, overwrite: bool = False,
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write the header-only (or sparse) checkpoint of Kimi-K3 (``sizes`` overrides ``KIMI_K3_SIZES``)."""
    path = fresh_dir(path, overwrite)
    config, tensors, ignore = layout_tensors({**KIMI_K3_SIZES, **(sizes or {})})
    config["text_config"]["quantization_config"] = mxfp4_quantization_config(ignore)
    write_layout(path, config, tensors, sparse=sparse, shard_bytes=shard_bytes)
    for fname in REMOTE_CODE_FILES:
        (path / fname).write_text(remote_code_source(fname))
    make_byte_tokenizer(path, bos_token_id=config["bos_token_id"], eos_token_id=config["eos_token_id"],
                        pad_token_id=config["pad_token_id"], media_token_id=config["media_placeholder_token_id"],
                        vocab_size=config["text_config"]["vocab_size"])
    return path

