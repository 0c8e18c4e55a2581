"""The DeepSeek-V3 NVFP4 export against nvidia-modelopt 0.47.0's export of the same block-FP8 stand-in on the
same calibration ids (tests/data/modelopt_0_47_deepseek_v3_golden.json, scripts/modelopt_golden_deepseek_v3.py;
how it was made: tests/data/README.md)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from _exports import read_export

pytestmark = pytest.mark.slow

GOLDEN = json.loads((Path(__file__).parents[2] / "data" / "modelopt_0_47_deepseek_v3_golden.json").read_text())


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _row(t: torch.Tensor) -> dict:
    row = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": _sha(t)}
    if t.numel() == 1 and t.is_floating_point():
        row["value"] = t.float().item().hex()
    return row


def _is_router(key: str) -> bool:
    return key.endswith(".mlp.gate.weight")


def assert_equals_modelopt_golden(export: Path) -> None:
    """Every tensor bit for bit (input_scale included), hf_quant_config's quantization and config.json's
    quantization_config equal. One stated exception (docs/decisions/0027-deepseek-v3.md): the routers, which we
    write as the checkpoint stores them (BF16) and ModelOpt's HF export writes as transformers holds them
    (upcast to FP32): their FP32 values must be ModelOpt's bytes."""
    golden, ours = GOLDEN["tensors"], read_export(export)
    assert set(ours) == set(golden)
    routers = [k for k in golden if _is_router(k)]
    assert len(routers) == 2
    for key, want in golden.items():
        t = ours[key]
        if _is_router(key):
            assert t.dtype == torch.bfloat16 and want["dtype"] == "float32", key
            t = t.float()  # exact: every BF16 value is an FP32 value
        assert _row(t) == want, key
    hf_quant = json.loads((export / "hf_quant_config.json").read_text())
    assert hf_quant["producer"] == GOLDEN["hf_quant_config"]["producer"]
    assert hf_quant["quantization"] == GOLDEN["hf_quant_config"]["quantization"]
    config = json.loads((export / "config.json").read_text())
    assert config["quantization_config"] == GOLDEN["config_quantization_config"]


def test_export_equals_modelopt_0_47(deepseek_fp8_export):
    """Our recipe models/deepseek-ai/DeepSeek-V3/nvfp4 (NVFP4 MLPs, experts and o_proj; q_a/q_b/kv_a/kv_b, router
    and lm_head kept; every expert calibrated on every token) == ModelOpt 0.47 with ptq.py's DeepSeek entries
    and its CalibMoe all-experts forward, on transformers' model of the same dequantized weights."""
    assert_equals_modelopt_golden(deepseek_fp8_export)


def test_the_stand_in_holds_negative_zeros_where_nvfp4_quantizes(deepseek_fp8_ckpt):
    """What gives the sign-of-zero rule teeth in the comparison above: FP8 weights of NVFP4-quantized Linears hold
    exact -0.0 (E4M3 0x80), which ModelOpt writes as code +0 (nvfp4_quantize too; tests/numerics)."""
    from modelopt_k3.testing.reference import read_checkpoint

    stored = read_checkpoint(deepseek_fp8_ckpt)
    negative_zero = [k for k, t in stored.items() if t.dtype == torch.float8_e4m3fn
                     and (".mlp." in k or ".o_proj." in k) and bool((t.view(torch.uint8) == 0x80).any())]
    assert len(negative_zero) >= 4, negative_zero
