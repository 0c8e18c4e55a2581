"""Generator for a tiny Qwen3-MoE stand-in checkpoint (transformers' own ``Qwen3Moe*`` classes, no remote code).

The directory looks like a hub Qwen3-MoE checkpoint (Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B): ``config.json``
with ``model_type: qwen3_moe`` and no ``auto_map``, BF16 tensors in several safetensors shards with an index,
and the routed experts stored one Linear per expert (``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``)
next to the router ``model.layers.{i}.mlp.gate.weight``; transformers 5 fuses them into ``gate_up_proj`` /
``down_proj`` when it loads (its ``qwen2_moe`` conversion mapping). Layers listed in ``mlp_only_layers`` (or
off the ``decoder_sparse_step`` grid) hold a dense ``Qwen3MoeMLP`` instead, as in the config's semantics.

Names and shapes come from transformers' own ``Qwen3MoeForCausalLM`` built on the meta device from a
``Qwen3MoeConfig``; values are deterministic in ``seed`` and each tensor's name (the Kimi-K3 generator's
per-tensor seeding). In every MoE layer one expert's ``up_proj`` and another's ``gate_proj`` hold the largest
magnitude of their pair, so a shared gate/up ``weight_scale_2`` taken from one projection alone is wrong.

``outliers=True`` (off by default: the default files are byte-identical with or without this option) makes the
values heavy-tailed as a trained LLM's are, so that the weight algorithms (mse, gptq, ...) have something to
improve on: a few hidden channels (``outlier_channels``, chosen by seed) get their ``input_layernorm`` /
``post_attention_layernorm`` weight scaled by 20-100x (every Linear fed by a norm then sees a few huge input
channels, as the massive-activation channels of real models), and every projection's weight is drawn
Student-t (3 degrees of freedom, unit variance: heavy-tailed elements) with a few rows raised 4-10x. The extra
draws come from their own generators (seed, name), so the base values, and the default files, do not move.
Still a random model: it shows the algorithms' mechanics on outlier-shaped inputs, not their quality.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .tiny import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, _tensor_generator, fresh_dir, write_stand_in
from .tokenizer import calibration_token_ids as calibration_token_ids

# Small, but every dim a multiple of 16 (NVFP4 block) and the head count GQA (4 query / 2 KV heads).
QWEN3_MOE_TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    # One dense layer in the middle: the spec must follow the config, not assume "every layer is MoE".
    "mlp_only_layers": [1],
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

_EXPERT_RE = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<param>gate_up_proj|down_proj)$")
_LAYER_RE = re.compile(r"\.layers\.(?P<layer>\d+)\.")


def checkpoint_config(s: dict[str, Any]) -> dict[str, Any]:
    """config.json as the hub writes it for sizes ``s`` (the fields of Qwen3-30B-A3B's config)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **s,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": 4096,
        "max_window_layers": s["num_hidden_layers"],
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "sliding_window": None,
        "use_sliding_window": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "torch_dtype": "bfloat16",
    }


def _meta_model(config: dict[str, Any]) -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg))


def raised_gate_up_expert(layer: int, num_experts: int) -> dict[str, int]:
    """Per MoE layer, the expert whose up_proj (``"up_proj"``) and the one whose gate_proj (``"gate_proj"``)
    holds the largest magnitude of its gate/up pair (4x the typical scale in one element)."""
    return {"up_proj": layer % num_experts, "gate_proj": (layer + num_experts // 2) % num_experts}


# outliers=True: how many hidden channels carry outliers, their norm-weight factors, the raised rows.
OUTLIER_CHANNELS = 4
OUTLIER_FACTOR = (20.0, 100.0)
OUTLIER_ROW_FRACTION = 1 / 16
OUTLIER_ROW_FACTOR = (4.0, 10.0)
_OUTLIER_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


def outlier_channels(seed: int, hidden_size: int) -> dict[int, float]:
    """``outliers=True``: hidden channel -> the factor its decoder-layer norm weights are scaled by (the same
    channels in every layer, as real models' outlier channels persist through the residual stream)."""
    gen = _tensor_generator(seed, "#outlier_channels")
    channels = torch.randperm(hidden_size, generator=gen)[:OUTLIER_CHANNELS].tolist()
    lo, hi = OUTLIER_FACTOR
    factors = (lo + (hi - lo) * torch.rand(len(channels), generator=gen)).tolist()
    return dict(zip(sorted(channels), factors))


def _with_outliers(name: str, value: torch.Tensor, seed: int, channels: dict[int, float]) -> torch.Tensor:
    """``value`` made heavy-tailed (``outliers=True``); draws from their own generator, keyed by ``name``."""
    if name.endswith(_OUTLIER_NORMS):
        value = value.clone()
        for c, f in channels.items():
            value[c] *= f
        return value
    if name.endswith("norm.weight") or name.endswith("embed_tokens.weight") or value.dim() != 2:
        return value
    gen = _tensor_generator(seed, name + "#outliers")
    rows, cols = value.shape
    # Student-t with 3 degrees of freedom, scaled to unit variance (t3's variance is 3), then the layer's scale.
    chi2 = (torch.randn((3, rows, cols), generator=gen) ** 2).sum(0)
    t3 = torch.randn((rows, cols), generator=gen) / (chi2 / 3).sqrt() / math.sqrt(3.0)
    value = t3 / math.sqrt(cols)
    raised = torch.randperm(rows, generator=gen)[: max(1, round(rows * OUTLIER_ROW_FRACTION))]
    lo, hi = OUTLIER_ROW_FACTOR
    value[raised] *= (lo + (hi - lo) * torch.rand(len(raised), generator=gen))[:, None]
    return value


def _value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    randn = torch.randn(shape, generator=gen)
    if name.endswith("norm.weight"):
        return 1.0 + 0.05 * randn
    if name.endswith("embed_tokens.weight"):
        return randn
    return randn / math.sqrt(shape[-1])


def _checkpoint_tensors(model: Any, seed: int, outliers: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, BF16 tensor) in module-tree order; fused experts written back as per-expert Linears."""
    channels = outlier_channels(seed, model.config.hidden_size) if outliers else {}

    def value_of(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        value = _value(key, shape, _tensor_generator(seed, key))
        return _with_outliers(key, value, seed, channels) if outliers else value

    for name, param in model.named_parameters():
        m = _EXPERT_RE.match(name)
        if m is None:
            yield name, value_of(name, tuple(param.shape)).to(torch.bfloat16)
            continue
        layer = int(_LAYER_RE.search(name)["layer"])
        num_experts, rows, cols = param.shape
        raised = raised_gate_up_expert(layer, num_experts)
        projs = ("gate_proj", "up_proj") if m["param"] == "gate_up_proj" else ("down_proj",)
        for e in range(num_experts):
            for proj in projs:
                key = f"{m['prefix']}.{e}.{proj}.weight"
                value = value_of(key, (rows // len(projs), cols))
                if raised.get(proj) == e:
                    value.view(-1)[0] = 4.0 * value.abs().max()
                yield key, value.to(torch.bfloat16)


def _resolve_sizes(sizes: dict[str, Any]) -> dict[str, Any]:
    unknown = set(sizes) - set(QWEN3_MOE_TINY_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown tiny Qwen3-MoE setting(s) {sorted(unknown)}; known: {sorted(QWEN3_MOE_TINY_DEFAULTS)}")
    s = {**QWEN3_MOE_TINY_DEFAULTS, **sizes}
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "head_dim"):
        if s[key] % 16:
            raise ValueError(f"{key}={s[key]} must be a multiple of 16 (the NVFP4 block)")
    return s


def make_tiny_qwen3_moe(
    path: str | Path, *, seed: int = 0, overwrite: bool = False, max_shard_size: int | None = None,
    outliers: bool = False, **sizes: Any
) -> Path:
    """Write a tiny Qwen3-MoE checkpoint into ``path`` and return it (``sizes`` override
    ``QWEN3_MOE_TINY_DEFAULTS``). The same seed, sizes and ``outliers`` give byte-identical files; about
    three shards. ``outliers``: heavy-tailed activations and weights (the module docstring)."""
    if not isinstance(outliers, bool):
        raise TypeError(f"outliers must be True or False, got {outliers!r}")
    path = fresh_dir(path, overwrite)
    s = _resolve_sizes(sizes)
    config = checkpoint_config(s)
    tensors = list(_checkpoint_tensors(_meta_model(config), seed, outliers))
    return write_stand_in(path, tensors, config, vocab_size=s["vocab_size"], max_shard_size=max_shard_size)

