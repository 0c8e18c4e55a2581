"""Generator for a tiny DeepSeek-V3 stand-in checkpoint (transformers' own ``DeepseekV3*`` classes, no remote code).

The directory looks like a hub DeepSeek-V3/R1 (``source="block_fp8"``) or Kimi-K2.5-style (``source="int4"``)
checkpoint: ``config.json`` with ``model_type: deepseek_v3`` and its ``quantization_config``, several
safetensors shards with an index, the routed experts stored one Linear per expert
(``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.*``) next to the router ``mlp.gate.weight`` (BF16)
and its ``mlp.gate.e_score_correction_bias`` (F32), the first ``first_k_dense_replace`` layers dense.

- ``block_fp8`` (DeepSeek-V3/R1, Kimi-K2): every decoder Linear (MLA projections, dense MLP, shared and routed
  experts) stores ``weight`` float8_e4m3fn + ``weight_scale_inv`` F32 ``[ceil(out/128), ceil(in/128)]``
  (``numerics.fp8_quantize_blockwise`` of a BF16 draw: partial edge blocks use their own amax); the
  embeddings, lm_head, norms and router are BF16. The default widths are 128-aligned where DeepSeek-V3's
  are, and partial where its are: ``kv_a_proj_with_mqa`` has ``kv_lora_rank + qk_rope_head_dim = 160``
  rows (DeepSeek-V3: 576), ``q_b_proj`` ``2 * 96 = 192``.
- ``int4`` (Kimi-K2.5/K2.6): the routed experts are compressed-tensors ``pack-quantized`` INT4 (group 32,
  symmetric: ``weight_packed`` int32, ``weight_scale`` BF16, ``weight_shape`` int32), everything else BF16.
- ``bf16``: everything BF16 (a dequantized DeepSeek-V3).

Values are deterministic in ``seed`` and each tensor's name (the Kimi-K3 generator's per-tensor seeding).
The tests decode the checkpoint with independent references (``tests/models/deepseek_v3/test_deepseek_v3.py``
``_dequantized_copy``) to give transformers' own model what it must be given to equal ours.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..numerics.fp8 import fp8_quantize_blockwise
from ..numerics.int4_packed import int4_pack
from .tiny import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, _tensor_generator, fresh_dir, write_stand_in
from .tokenizer import calibration_token_ids as calibration_token_ids

SOURCES = ("block_fp8", "int4", "bf16")
INT4_GROUP = 32

DEEPSEEK_V3_TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 384,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

_EXPERT_RE = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<param>gate_up_proj|down_proj)$")
_LINEAR_RE = re.compile(r"\.(self_attn\.\w+_proj(?:_with_mqa)?|mlp\.(?:shared_experts\.)?(?:gate|up|down)_proj)\.weight$")


def fp8_quantization_config() -> dict[str, Any]:
    """DeepSeek-V3/R1's ``quantization_config`` (hub config.json)."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def int4_quantization_config(ignore: list[str]) -> dict[str, Any]:
    """Kimi-K2.5/K2.6-style compressed-tensors INT4 experts (group 32, symmetric)."""
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": INT4_GROUP, "symmetric": True,
               "dynamic": False, "observer": "minmax", "actorder": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ignore, "kv_cache_scheme": None}


def checkpoint_config(s: dict[str, Any]) -> dict[str, Any]:
    """config.json as the hub writes it for sizes ``s`` (the fields of DeepSeek-V3's config), unquantized."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **s,
        "hidden_act": "silu",
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "num_nextn_predict_layers": 0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "torch_dtype": "bfloat16",
    }


def _meta_model(config: dict[str, Any]) -> Any:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "quantization_config")}
    with torch.device("meta"):
        return DeepseekV3ForCausalLM(DeepseekV3Config(**cfg))


def _value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    randn = torch.randn(shape, generator=gen)
    if name.endswith("norm.weight"):
        return 1.0 + 0.05 * randn
    if name.endswith("embed_tokens.weight"):
        return randn
    if name.endswith("e_score_correction_bias"):
        return 0.01 * randn
    return randn / math.sqrt(shape[-1])


def _persistent(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield f"{module_name}.{name}", buf


def _int4_fields(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Symmetric INT4 group-32 quantization of ``w`` (scale = group amax / 7, round to nearest, clamp -8..7)."""
    groups = w.float().unflatten(-1, (-1, INT4_GROUP))
    scale = (groups.abs().amax(-1) / 7.0).clamp(min=1e-8).bfloat16()
    q = torch.round(groups / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int8).flatten(-2)
    return {"weight_packed": int4_pack(q), "weight_scale": scale,
            "weight_shape": torch.tensor(list(w.shape), dtype=torch.int32)}


def _stored(key: str, w: torch.Tensor, source: str, expert: bool) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of one Linear weight ``key`` (``….weight``) drawn as ``w`` (fp32)."""
    head = key.removesuffix(".weight")
    if source == SOURCES[0] and (expert or _LINEAR_RE.search(key)):
        q, scale = fp8_quantize_blockwise(w.bfloat16().float())
        return [(key, q), (f"{head}.weight_scale_inv", scale)]
    if source == "int4" and expert:
        return [(f"{head}.{name}", t) for name, t in _int4_fields(w.bfloat16()).items()]
    return [(key, w.to(torch.bfloat16))]


def _checkpoint_tensors(model: Any, seed: int, source: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) in module-tree order; fused experts written back as per-expert Linears."""
    for name, param in _persistent(model):
        m = _EXPERT_RE.match(name)
        if m is None:
            value = _value(name, tuple(param.shape), _tensor_generator(seed, name))
            if name.endswith("e_score_correction_bias"):
                yield name, value.float()
            else:
                yield from _stored(name, value, source, expert=False)
            continue
        num_experts, rows, cols = param.shape
        projs = ("gate_proj", "up_proj") if m["param"] == "gate_up_proj" else ("down_proj",)
        for e in range(num_experts):
            for proj in projs:
                key = f"{m['prefix']}.{e}.{proj}.weight"
                yield from _stored(key, _value(key, (rows // len(projs), cols), _tensor_generator(seed, key)), source,
                                   expert=True)


def _mtp_tensors(config: dict[str, Any], seed: int, source: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of every MTP layer (the spec's ``mtp_layer_shapes``): the decoder layer stored as
    ``source`` stores the others, the MTP modules BF16 (as DeepSeek-V3's hub checkpoint)."""
    from ..models.deepseek_v3.source_layout import mtp_layer_shapes

    first = config["num_hidden_layers"]
    for layer in range(first, first + config["num_nextn_predict_layers"]):
        for name, shape in mtp_layer_shapes(config, layer).items():
            value = _value(name, shape, _tensor_generator(seed, name))
            if name.endswith("e_score_correction_bias"):
                yield name, value.float()
            else:
                expert = ".mlp.experts." in name
                yield from _stored(name, value, source, expert=expert)


def _resolve_sizes(sizes: dict[str, Any]) -> dict[str, Any]:
    unknown = set(sizes) - set(DEEPSEEK_V3_TINY_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown tiny DeepSeek-V3 setting(s) {sorted(unknown)}; known: {sorted(DEEPSEEK_V3_TINY_DEFAULTS)}")
    s = {**DEEPSEEK_V3_TINY_DEFAULTS, **sizes}
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank"):
        if s[key] % 32:
            raise ValueError(f"{key}={s[key]} must be a multiple of 32 (the NVFP4 block and the INT4 group)")
    return s


def make_tiny_deepseek_v3(
    path: str | Path, *, source: str = "block_fp8", seed: int = 0, overwrite: bool = False,
    max_shard_size: int | None = None, num_nextn_predict_layers: int = 0, **sizes: Any,
) -> Path:
    """Write a tiny DeepSeek-V3 checkpoint stored as ``source`` (``block_fp8``, ``int4`` or ``bf16``) into ``path``
    and return it (``sizes`` override ``DEEPSEEK_V3_TINY_DEFAULTS``). Same arguments, byte-identical files.

    ``num_nextn_predict_layers``: MTP layers stored after the decoder layers as ``model.layers.{num_hidden_layers +
    j}`` (``models.deepseek_v3.source_layout.mtp_layer_shapes``), their tensors last; 0 (the default) writes exactly the files it always wrote."""
    if source not in SOURCES:
        raise ValueError(f"source={source!r}; one of {SOURCES}")
    if not isinstance(num_nextn_predict_layers, int) or num_nextn_predict_layers < 0:
        raise ValueError(f"num_nextn_predict_layers={num_nextn_predict_layers!r}; a non-negative integer")
    path = fresh_dir(path, overwrite)
    s = _resolve_sizes(sizes)
    config = checkpoint_config(s)
    model = _meta_model(config)
    tensors = list(_checkpoint_tensors(model, seed, source))
    if num_nextn_predict_layers:
        config["num_nextn_predict_layers"] = num_nextn_predict_layers
        tensors += list(_mtp_tensors(config, seed, source))
    if source == SOURCES[0]:
        config["quantization_config"] = fp8_quantization_config()
    elif source == "int4":
        ignore = sorted({k.removesuffix(".weight") for k, _ in tensors if k.endswith(".weight")
                         and (_LINEAR_RE.search(k) or k == "lm_head.weight"
                              or k.endswith((".eh_proj.weight", ".shared_head.head.weight")))})
        config["quantization_config"] = int4_quantization_config(ignore)
    return write_stand_in(path, tensors, config, vocab_size=s["vocab_size"], max_shard_size=max_shard_size)

