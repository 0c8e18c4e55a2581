"""The GLM-5 NVFP4 export against nvidia-modelopt 0.47.0's export of the same stand-in on the same calibration ids
(tests/data/modelopt_0_47_glm_moe_dsa_golden.json, written by scripts/modelopt_golden_glm_moe_dsa.py), both under
ModelOpt's NVFP4_DEFAULT_CFG (ours: presets/nvfp4_default): MLA, the DSA indexer's wq_b/wk/weights_proj, dense and
shared MLPs and routed experts NVFP4 with calibrated input scales."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from _exports import read_export

from modelopt_k3.testing.glm_moe_dsa import calibration_token_ids

pytestmark = pytest.mark.slow

GOLDEN = json.loads((Path(__file__).parents[2] / "data" / "modelopt_0_47_glm_moe_dsa_golden.json").read_text())


def _row(t: torch.Tensor) -> dict:
    row = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
           "sha256": hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()}
    if t.numel() == 1 and t.is_floating_point():
        row["value"] = t.float().item().hex()
    return row


def test_export_equals_modelopt_0_47(glm_ckpt, tmp_path):
    """Every tensor ModelOpt writes, bit for bit (input_scale included), and its hf_quant_config / quantization_config.
    Two stated differences: the routers, which we write as the checkpoint stores them (BF16) and ModelOpt as
    transformers holds them (upcast to FP32: their FP32 values must be ModelOpt's bytes); and the MTP layer
    (``model.layers.3``), which transformers does not load, so ModelOpt's export drops it while ours carries it
    (and excludes it)."""
    import modelopt_k3

    model = modelopt_k3.load_pretrained(glm_ckpt, progress=False)
    ids = calibration_token_ids()

    def loop(m):
        with torch.no_grad():
            m(input_ids=ids)

    modelopt_k3.quantize(model, "presets/nvfp4_default", loop, verbose=False)
    out = modelopt_k3.export_checkpoint(model, tmp_path / "export", progress=False)
    golden, ours = GOLDEN["tensors"], read_export(out)
    assert set(ours) - set(golden) == {k for k in ours if k.startswith("model.layers.3.")} != set()
    assert any(".indexer.wq_b.weight_scale_2" in k for k in golden)
    routers = [k for k in golden if k.endswith(".mlp.gate.weight")]
    assert len(routers) == 2
    for key, want in golden.items():
        t = ours[key]
        if key in routers:
            assert t.dtype == torch.bfloat16 and want["dtype"] == "float32", key
            t = t.float()  # exact: every BF16 value is an FP32 value
        assert _row(t) == want, key
    quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    want = GOLDEN["hf_quant_config"]["quantization"]
    assert {**quant, "exclude_modules": [m for m in quant["exclude_modules"] if m != "model.layers.3*"]} == want
    assert "model.layers.3*" in quant["exclude_modules"]
