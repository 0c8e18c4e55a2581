"""TensorRT-LLM's GPT-OSS rule (``models/gpt_oss/serving.py`` ``replay_trtllm``) on hand-built headers: its loader
reads the MoE under the fused names only, so a per-expert export is refused at each layer's first expert tensor,
in any format; a layout without per-expert tensors is not replayed (refused, saying so)."""

from __future__ import annotations

import pytest
import torch

from modelopt_k3.check.engines import replay
from modelopt_k3.check.layout import Layout, Linear, TensorMeta
from modelopt_k3.check.report import REFUSES


def _layout(expert_dtype: torch.dtype | None, layers: int = 2) -> Layout:
    linears = {}
    for layer in range(layers):
        attn = f"model.layers.{layer}.self_attn.q_proj"
        linears[attn] = Linear(attn, {"weight": TensorMeta(torch.bfloat16, (64, 64))})
        for e in range(2 if expert_dtype is not None else 0):
            for proj, shape in (("gate_up_proj", (64, 64)), ("down_proj", (64, 32))):
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                linears[name] = Linear(name, {"weight": TensorMeta(expert_dtype, shape)})
    return Layout(config={"model_type": "gpt_oss"}, quant=None, hf_quant=None, linears=linears, kv_scales={},
                  tensors={})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_per_expert_experts_are_refused_per_layer(dtype):
    result = replay("trtllm", _layout(dtype))
    assert result.verdict == REFUSES
    assert [r.tensor for r in result.refusals] == [f"model.layers.{i}.mlp.experts.0.down_proj.weight" for i in (0, 1)]
    assert "load_hf_weights" in result.refusals[0].reason and "KeyError" in result.refusals[0].reason


def test_a_layout_without_per_expert_tensors_is_not_replayed():
    result = replay("trtllm", _layout(None))
    assert [r.tensor for r in result.refusals] == ["config.json"]
    assert "only for per-expert" in result.refusals[0].reason
