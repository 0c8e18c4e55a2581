"""SGLang 0.5.23's GPT-OSS rule (``models/gpt_oss/serving.py`` ``replay_sglang``) on hand-built headers: quantized
attention is refused (``GptOssAttention`` is built without a quant config), per-expert experts in any format are
skipped without an error -- "serves different numbers", not "refuses" -- and a layout with neither is not replayed."""

from __future__ import annotations

import pytest
import torch

from modelopt_k3.check.engines import replay
from modelopt_k3.check.layout import Layout, Linear, TensorMeta
from modelopt_k3.check.report import DIFFERENT, REFUSES

NVFP4_TENSORS = {"weight": TensorMeta(torch.uint8, (64, 32)), "weight_scale": TensorMeta(torch.float8_e4m3fn, (64, 4)),
                 "weight_scale_2": TensorMeta(torch.float32, ()), "input_scale": TensorMeta(torch.float32, ())}


def _layout(attention_nvfp4: bool, expert_dtype: torch.dtype | None) -> Layout:
    linears = {}
    for layer in (0, 1):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}"
            linears[name] = Linear(name, dict(NVFP4_TENSORS) if attention_nvfp4
                                   else {"weight": TensorMeta(torch.bfloat16, (64, 64))})
        for e in range(2 if expert_dtype is not None else 0):
            for proj in ("gate_up_proj", "down_proj"):
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                linears[name] = Linear(name, dict(NVFP4_TENSORS) if expert_dtype == torch.uint8
                                       else {"weight": TensorMeta(expert_dtype, (64, 64))})
    return Layout(config={"model_type": "gpt_oss"}, quant=None, hf_quant=None, linears=linears, kv_scales={},
                  tensors={})


def test_quantized_attention_is_refused_at_each_projection():
    result = replay("sglang", _layout(True, torch.uint8))
    assert result.verdict == REFUSES
    assert len(result.refusals) == 8 and all(".self_attn." in r.tensor for r in result.refusals)
    assert "GptOssAttention without a quant config" in result.refusals[0].reason


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_per_expert_experts_are_silently_skipped(dtype):
    result = replay("sglang", _layout(False, dtype))
    assert result.verdict == DIFFERENT and not result.refusals
    assert [d.module for d in result.deviations] == [f"model.layers.{i}.mlp.experts" for i in (0, 1)]
    assert "_load_normal_weights" in result.deviations[0].what
    # NVFP4 experts: SGLang's auto MoE runner for GPT-OSS (triton_kernel) refuses them at the first forward.
    assert [w for w in result.warnings if "triton_kernel" in w] == ([] if dtype == torch.bfloat16 else result.warnings)
    assert bool(result.warnings) == (dtype == torch.uint8)


def test_a_layout_without_per_expert_tensors_is_not_replayed():
    result = replay("sglang", _layout(False, None))
    assert [r.tensor for r in result.refusals] == ["config.json"]
