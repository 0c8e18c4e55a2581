"""The ModelOpt format module: declared layouts match the tensors written; config builders."""

from __future__ import annotations

import pytest
import torch

from modelopt_k3.export.modelopt_format import (
    config_quantization_config,
    hf_quant_config,
    linear_layout,
    nvfp4_weight_tensors,
    weight_tensors,
)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "fp8_pb"])
@pytest.mark.parametrize("shape", [(64, 128), (96, 200 - 200 % 16), (2, 128), (300, 272)])
def test_layout_matches_written_tensors(fmt, shape):
    w = torch.randn(shape).to(torch.bfloat16)
    scale = None if fmt == "fp8_pb" else w.float().abs().max() / (6 * 448 if fmt == "nvfp4" else 448)
    written = weight_tensors(fmt, w, scale)
    declared = linear_layout(fmt, shape, input_scale=False)
    assert [(k, t.dtype, tuple(t.shape)) for k, t in written.items()] == declared


def test_unknown_format_refused():
    with pytest.raises(ValueError, match="unknown weight format"):
        linear_layout("int4", (16, 16), input_scale=False)


def test_hf_quant_config_single_and_mixed():
    single = hf_quant_config({"a.q_proj": "NVFP4", "b.q_proj": "NVFP4"}, kv_cache="fp8", exclude_modules=["lm_head"])
    q = single["quantization"]
    assert q["quant_algo"] == "NVFP4" and q["group_size"] == 16 and q["kv_cache_quant_algo"] == "FP8"
    assert "quantized_layers" not in q and q["exclude_modules"] == ["lm_head"]
    cfg = config_quantization_config(single)
    assert cfg["quant_method"] == "modelopt" and cfg["ignore"] == ["lm_head"]
    assert cfg["config_groups"]["group_0"]["weights"] == {"num_bits": 4, "type": "float", "group_size": 16}
    assert cfg["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "dynamic": False}

    mixed = hf_quant_config({"e.w1": "NVFP4", "a.q_proj": "FP8_PB_WO"}, kv_cache=None, exclude_modules=[])
    q = mixed["quantization"]
    assert q["quant_algo"] == "MIXED_PRECISION" and q["kv_cache_quant_algo"] is None
    assert q["quantized_layers"] == {
        "a.q_proj": {"quant_algo": "FP8_PB_WO", "block_size": [128, 128]},
        "e.w1": {"quant_algo": "NVFP4", "group_size": 16},
    }
    assert len(config_quantization_config(mixed)["config_groups"]) == 2


def test_nvfp4_weight_scale_2_is_the_given_scalar():
    w = torch.randn(32, 64)
    gs = w.abs().max() / 2688.0
    t = nvfp4_weight_tensors(w, gs)
    assert t["weight_scale_2"].shape == () and t["weight_scale_2"].dtype == torch.float32
    assert torch.equal(t["weight_scale_2"], gs.float())
