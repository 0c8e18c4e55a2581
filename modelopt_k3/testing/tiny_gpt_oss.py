"""Generator for a tiny GPT-OSS stand-in checkpoint (transformers' own ``GptOss*`` classes, no remote code).

The directory looks like openai/gpt-oss-20b/120b as the hub ships them: config.json from transformers'
``GptOssConfig`` with ``quantization_config = {quant_method: "mxfp4", modules_to_not_convert: [...]}``,
routed experts stored fused per layer in the OpenAI MXFP4 layout (``mlp.experts.gate_up_proj_blocks``
uint8 ``[E, 2I, H/32, 16]``, ``..._scales`` uint8 E8M0 ``[E, 2I, H/32]``, the same for ``down_proj``
with ``[E, H, I/32, 16]`` / ``[E, H, I/32]``; gate and up rows interleaved), BF16 expert biases, the
router's weight and bias, attention biases and ``sinks``, sharded safetensors with an index and the
project's byte tokenizer. Weights are deterministic in ``seed`` and each tensor's name.

In every MoE layer one expert's up rows (odd rows of gate_up) and another's gate rows (even rows) hold one
E8M0 exponent above the jitter range, so a shared gate/up ``weight_scale_2`` taken from one half alone
differs from the right one (as ``tiny.raised_gate_up_expert`` does for Kimi-K3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from modelopt_k3.testing.tiny import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    MXFP4_GROUP,
    PAD_TOKEN_ID,
    _dense_value,
    _mxfp4_expert_weight,
    _tensor_generator,
    fresh_dir,
    raised_gate_up_expert,
    write_stand_in,
)

TINY_GPT_OSS_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}

# The real checkpoints' modules_to_not_convert: only the routed experts are MXFP4.
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
# The fused experts parameters (transformers' in-memory names) stored as OpenAI MXFP4 blocks + scales.
_MXFP4_PARAMS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def gpt_oss_quantization_config() -> dict[str, Any]:
    """The real checkpoints' quantization_config (transformers' ``Mxfp4Config`` reads it)."""
    return {"quant_method": "mxfp4", "modules_to_not_convert": list(MODULES_TO_NOT_CONVERT)}


def gpt_oss_config(**sizes: Any):
    """transformers' ``GptOssConfig`` with the tiny sizes (``sizes`` override the defaults)."""
    from transformers import GptOssConfig

    unknown = set(sizes) - set(TINY_GPT_OSS_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown tiny GPT-OSS setting(s) {sorted(unknown)}; known: {sorted(TINY_GPT_OSS_DEFAULTS)}")
    s = {**TINY_GPT_OSS_DEFAULTS, **sizes}
    for key in ("hidden_size", "intermediate_size"):
        if s[key] % MXFP4_GROUP:
            raise ValueError(f"{key}={s[key]} must be a multiple of {MXFP4_GROUP} (MXFP4 group size)")
    return GptOssConfig(
        **s,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        # As the real config: yarn RoPE over a 4096-token original window (scaled down with the model).
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16},
        dtype="bfloat16",
    )


def _openai_mxfp4(fused_name: str, num_experts: int, out: int, inp: int, gen: torch.Generator,
                  layer: int) -> dict[str, torch.Tensor]:
    """``_blocks [E, out, in/32, 16]`` and ``_scales [E, out, in/32]`` of one fused projection."""
    raised = raised_gate_up_expert(layer, num_experts) if fused_name.endswith("gate_up_proj") else {}
    blocks, scales = [], []
    for e in range(num_experts):
        mx = _mxfp4_expert_weight(out, inp, gen)
        scale = mx["weight_scale"]
        # gate rows are the even rows, up rows the odd ones: raise one block of each half in one expert.
        if raised.get("w1") == e:
            scale[0, 0] = scale[0::2].max() + 1
        if raised.get("w3") == e:
            scale[1, 0] = scale[1::2].max() + 1
        blocks.append(mx["weight_packed"].view(out, inp // MXFP4_GROUP, MXFP4_GROUP // 2))
        scales.append(scale)
    return {f"{fused_name}_blocks": torch.stack(blocks), f"{fused_name}_scales": torch.stack(scales)}


def _checkpoint_tensors(model, seed: int, num_experts: int):
    """(key, tensor) in module-tree order; the fused experts weights as OpenAI MXFP4 blocks/scales."""
    for name, param in model.named_parameters():
        gen = _tensor_generator(seed, name)
        if name.endswith(_MXFP4_PARAMS):
            layer = int(name.split(".layers.")[1].split(".")[0])
            _, inp, out = param.shape  # transformers declares [E, in, out]; the checkpoint stores [E, out, in]
            yield from _openai_mxfp4(name, num_experts, out, inp, gen, layer).items()
            continue
        value = _dense_value(name, tuple(param.shape), gen, 0)
        if name.endswith("_bias") or name.endswith(".bias") or name.endswith(".sinks"):
            value = 0.1 * torch.randn(param.shape, generator=gen)
        yield name, value.to(torch.bfloat16).contiguous()


def make_tiny_gpt_oss(
    path: str | Path, *, seed: int = 0, overwrite: bool = False, max_shard_size: int | None = None, **sizes: Any
) -> Path:
    """Write a tiny GPT-OSS stand-in checkpoint into ``path`` and return it.

    ``sizes`` override ``TINY_GPT_OSS_DEFAULTS``; the same seed and sizes give byte-identical files;
    ``max_shard_size`` in bytes (default: about 3 shards).
    """
    from transformers import GptOssForCausalLM

    path = fresh_dir(path, overwrite)
    config = gpt_oss_config(**sizes)
    with torch.device("meta"):
        model = GptOssForCausalLM(config)
    tensors = list(_checkpoint_tensors(model, seed, config.num_local_experts))
    raw = config.to_dict()
    raw["architectures"] = ["GptOssForCausalLM"]
    raw["quantization_config"] = gpt_oss_quantization_config()
    return write_stand_in(path, tensors, raw, vocab_size=config.vocab_size, max_shard_size=max_shard_size,
                          sort_config_keys=True)
