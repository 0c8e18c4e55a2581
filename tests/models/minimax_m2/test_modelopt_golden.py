"""The MiniMax-M2 NVFP4 export against nvidia-modelopt 0.47.0's export of the same stand-in (decoded to BF16 by
transformers' own FP8 dequantize) on the same calibration ids (tests/data/modelopt_0_47_minimax_m2_golden.json,
written by scripts/modelopt_golden_minimax_m2.py), both under ModelOpt's NVFP4_DEFAULT_CFG (ours:
presets/nvfp4_default): attention and routed experts NVFP4 with calibrated input scales, in the hub's names
(ModelOpt 0.47 writes ``block_sparse_moe.experts.E.w1/w3/w2`` too)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from _exports import read_export

from modelopt_k3.testing.minimax_m2 import calibration_token_ids

pytestmark = pytest.mark.slow

GOLDEN = json.loads((Path(__file__).parents[2] / "data" / "modelopt_0_47_minimax_m2_golden.json").read_text())


def _row(t: torch.Tensor) -> dict:
    row = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
           "sha256": hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()}
    if t.numel() == 1 and t.is_floating_point():
        row["value"] = t.float().item().hex()
    return row


def test_export_equals_modelopt_0_47(minimax_m2_ckpt, tmp_path):
    """Every tensor bit for bit (input_scale included) and the configs equal. One stated difference: the router
    ``gate.weight`` and ``e_score_correction_bias``, which we write as the checkpoint stores them (FP32, the dtype
    vLLM and SGLang build them in) and ModelOpt as transformers holds them (rounded to BF16): ModelOpt's bytes must be
    ours rounded to BF16."""
    import modelopt_k3

    model = modelopt_k3.load_pretrained(minimax_m2_ckpt, progress=False)
    ids = calibration_token_ids()

    def loop(m):
        with torch.no_grad():
            m(input_ids=ids)

    modelopt_k3.quantize(model, "presets/nvfp4_default", loop, verbose=False)
    out = modelopt_k3.export_checkpoint(model, tmp_path / "export", progress=False)
    golden, ours = GOLDEN["tensors"], read_export(out)
    assert set(ours) == set(golden)
    routers = [k for k in golden if k.endswith((".block_sparse_moe.gate.weight", ".e_score_correction_bias"))]
    assert len(routers) == 4
    for key, want in golden.items():
        t = ours[key]
        if key in routers:
            assert t.dtype == torch.float32 and want["dtype"] == "bfloat16", key
            t = t.bfloat16()
        assert _row(t) == want, key
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"] == \
        GOLDEN["hf_quant_config"]["quantization"]
    assert json.loads((out / "config.json").read_text())["quantization_config"] == GOLDEN["config_quantization_config"]
