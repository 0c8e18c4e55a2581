"""GPT-OSS layouts: the stand-in is the real checkpoint layout, transformers reads it as our decoder does, and
the calibration-free NVFP4 cast in ModelOpt's layout reads back to the same values bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from modelopt_k3.models.gpt_oss.source_layout import (
    deinterleave,
    dequantize_bmm,
    interleave,
    layer_global_scale,
    mxfp4_fields,
    nvfp4_experts,
)
from modelopt_k3.numerics import mxfp4_decode
from modelopt_k3.testing.tiny_gpt_oss import MODULES_TO_NOT_CONVERT


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(path / shard, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
    assert set(out) == set(index["weight_map"])
    return out


@pytest.fixture(scope="module")
def ckpt_tensors(tiny_gpt_oss_ckpt: Path) -> dict[str, torch.Tensor]:
    return _tensors(tiny_gpt_oss_ckpt)


def test_stand_in_has_the_real_layout(tiny_gpt_oss_ckpt: Path, ckpt_tensors) -> None:
    cfg = json.loads((tiny_gpt_oss_ckpt / "config.json").read_text())
    assert cfg["model_type"] == "gpt_oss" and "auto_map" not in cfg  # transformers' own classes
    assert cfg["quantization_config"] == {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_TO_NOT_CONVERT}
    e, h, i = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    p = "model.layers.0.mlp.experts."
    expect = {
        "gate_up_proj_blocks": (torch.uint8, [e, 2 * i, h // 32, 16]),
        "gate_up_proj_scales": (torch.uint8, [e, 2 * i, h // 32]),
        "gate_up_proj_bias": (torch.bfloat16, [e, 2 * i]),
        "down_proj_blocks": (torch.uint8, [e, h, i // 32, 16]),
        "down_proj_scales": (torch.uint8, [e, h, i // 32]),
        "down_proj_bias": (torch.bfloat16, [e, h]),
    }
    for name, (dtype, shape) in expect.items():
        t = ckpt_tensors[p + name]
        assert (t.dtype, list(t.shape)) == (dtype, shape), name
    assert ckpt_tensors["model.layers.0.self_attn.sinks"].shape == (cfg["num_attention_heads"],)
    assert ckpt_tensors["model.layers.0.mlp.router.bias"].shape == (e,)
    assert not any(k.endswith(("gate_up_proj", "down_proj")) for k in ckpt_tensors)  # experts only as MXFP4
    shards = set(json.loads((tiny_gpt_oss_ckpt / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) >= 2


def test_transformers_dequantizes_as_our_decoder(gpt_oss_reference, ckpt_tensors) -> None:
    """transformers' MXFP4 integration (nibble order, E8M0 bias, transpose) == mxfp4_decode of our view, bit for bit."""
    n_layers = gpt_oss_reference.config.num_hidden_layers
    for layer in range(n_layers):
        experts = gpt_oss_reference.model.layers[layer].mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{layer}.mlp.experts.{proj}"
            packed, scale = mxfp4_fields(ckpt_tensors[key + "_blocks"], ckpt_tensors[key + "_scales"])
            ours = mxfp4_decode(packed, scale, torch.bfloat16).transpose(1, 2)
            assert torch.equal(getattr(experts, proj).data.view(torch.int16), ours.view(torch.int16)), key


def test_interleave_is_the_gate_up_order() -> None:
    t = torch.arange(2 * 3 * 8).view(2, 8, 3)
    d = deinterleave(t, 1)
    assert torch.equal(d[:, :4], t[:, 0::2]) and torch.equal(d[:, 4:], t[:, 1::2])
    assert torch.equal(interleave(d, 1), t)
    u = torch.arange(12).view(3, 4)
    assert torch.equal(deinterleave(u, -1), u[:, [0, 2, 1, 3]]) and torch.equal(interleave(deinterleave(u, -1), -1), u)


@pytest.mark.parametrize("proj", ["gate_up_proj", "down_proj"])
def test_nvfp4_cast_is_lossless_in_modelopt_layout(ckpt_tensors, proj: str) -> None:
    for layer in range(2):
        key = f"model.layers.{layer}.mlp.experts.{proj}"
        blocks, scales = ckpt_tensors[key + "_blocks"], ckpt_tensors[key + "_scales"]
        out, n_req = nvfp4_experts(blocks, scales)
        e, rows, g, _ = blocks.shape
        assert n_req == 0
        assert (out["weight"].dtype, list(out["weight"].shape)) == (torch.uint8, [e, g * 16, rows])
        assert (out["weight_scale"].dtype, list(out["weight_scale"].shape)) == (torch.float8_e4m3fn, [e, g * 2, rows])
        assert out["weight_scale_2"].shape == () and out["weight_scale_2"].dtype == torch.float32
        # One power of two per fused tensor, mapping its largest block scale (any expert, gate or up) to 2**8.
        assert float(out["weight_scale_2"]) == 2.0 ** (int(scales.max()) - 127 - 8)
        reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # transformers' decoder
        assert torch.equal(dequantize_bmm(out["weight"], out["weight_scale"], out["weight_scale_2"]), reference)


def test_cast_counts_blocks_below_the_window() -> None:
    """A block 18 binades under the largest cannot carry its codes (E4M3's power-of-two range is 2**-9..2**8)."""
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(1, 8, (2, 4, 2, 16), generator=gen, dtype=torch.uint8)  # no all-zero half-block
    scales = torch.full((2, 4, 2), 120, dtype=torch.uint8)
    scales[1, 3, 0] = 120 - 18
    out, n_req = nvfp4_experts(blocks, scales)
    assert n_req == 2  # both 16-halves of that one MXFP4 block
    got = dequantize_bmm(out["weight"], out["weight_scale"], out["weight_scale_2"])
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    differs = (got != want).any(dim=1)  # [E, rows]
    assert differs.nonzero().tolist() == [[1, 3]]
    assert float(layer_global_scale(scales)) == 2.0 ** (120 - 127 - 8)
