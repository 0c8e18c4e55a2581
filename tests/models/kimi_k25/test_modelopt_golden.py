"""The Kimi-K2.5 NVFP4 export against nvidia-modelopt 0.47.0's export of the same stand-in's text model on the same
calibration ids (tests/data/modelopt_0_47_kimi_k25_golden.json, scripts/modelopt_golden_kimi_k25.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from _exports import read_export

pytestmark = pytest.mark.slow

GOLDEN = json.loads((Path(__file__).parents[2] / "data" / "modelopt_0_47_kimi_k25_golden.json").read_text())
TEXT = "language_model."


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _golden_name(key: str) -> str:
    """Our hub name -> the name in ModelOpt's export of the text model alone (no ``language_model.``)."""
    return key.replace("language_model.model.", "model.", 1).replace("language_model.lm_head", "lm_head", 1)


@pytest.fixture(scope="module")
def golden_run_export(kimi_k25_ckpt, tmp_path_factory) -> Path:
    """Load, calibrate on ``calibration_token_ids()`` in one forward (what the golden's ModelOpt run saw), export."""
    import modelopt_k3
    from modelopt_k3.testing.kimi_k25 import calibration_token_ids

    model = modelopt_k3.load_pretrained(kimi_k25_ckpt, progress=False)
    ids = calibration_token_ids()

    def loop(m):
        with torch.no_grad():
            m(input_ids=ids)

    modelopt_k3.quantize(model, "models/moonshotai/Kimi-K2.5/nvfp4", loop, verbose=False)
    return modelopt_k3.export_checkpoint(model, tmp_path_factory.mktemp("kimi_k25_golden") / "export", progress=False)


def test_text_model_equals_modelopt_0_47(golden_run_export):
    """Every text tensor bit for bit (codes, every scale, input_scale); the one stated exception, as for DeepSeek-V3:
    the routers, which we write as stored (BF16) and ModelOpt writes upcast to FP32 -- their FP32 bytes must be
    ModelOpt's. The quant config is ModelOpt's with the hub prefix, plus the carried vision tower and projector."""
    ours = {_golden_name(k): t for k, t in read_export(golden_run_export).items() if k.startswith(TEXT)}
    golden = GOLDEN["tensors"]
    assert set(ours) == set(golden)
    for key, row in golden.items():
        t = ours[key]
        if key.endswith(".mlp.gate.weight"):
            assert t.dtype == torch.bfloat16 and row["dtype"] == "float32", key
            t = t.float()
        assert [str(t.dtype).removeprefix("torch."), list(t.shape), _sha(t)] == [row["dtype"], row["shape"],
                                                                                 row["sha256"]], key
    theirs = GOLDEN["hf_quant_config"]["quantization"]
    mine = json.loads((golden_run_export / "hf_quant_config.json").read_text())["quantization"]
    assert {k: mine[k] for k in ("quant_algo", "kv_cache_quant_algo", "group_size")} == {
        k: theirs[k] for k in ("quant_algo", "kv_cache_quant_algo", "group_size")}
    assert sorted(_golden_name(e) for e in mine["exclude_modules"] if e.startswith(TEXT)) == theirs["exclude_modules"]
    assert sorted(e for e in mine["exclude_modules"] if not e.startswith(TEXT)) == ["mm_projector*", "vision_tower*"]
