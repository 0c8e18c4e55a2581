"""The tiny DeepSeek-V3 stand-ins (block-FP8 and INT4 experts, built once per session) and the calibrated
NVFP4 export of the FP8 one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelopt_k3.testing.deepseek_v3 import calibration_token_ids, make_tiny_deepseek_v3

RECIPE = "models/deepseek-ai/DeepSeek-V3/nvfp4"
W4A16 = "models/deepseek-ai/DeepSeek-V3/w4a16_nvfp4"  # the converter's default (weight-only, calibration-free)


@pytest.fixture(scope="session")
def deepseek_fp8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_deepseek_v3(tmp_path_factory.mktemp("tiny_deepseek_v3_fp8") / "ckpt", source="block_fp8")


@pytest.fixture(scope="session")
def deepseek_int4_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_deepseek_v3(tmp_path_factory.mktemp("tiny_deepseek_v3_int4") / "ckpt", source="int4")


@pytest.fixture(scope="session")
def deepseek_bf16_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_deepseek_v3(tmp_path_factory.mktemp("tiny_deepseek_v3_bf16") / "ckpt", source="bf16")


@pytest.fixture(scope="session")
def deepseek_mtp_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """source -> a stand-in with one MTP layer (``model.layers.3``), for block_fp8, int4 and bf16."""
    root = tmp_path_factory.mktemp("tiny_deepseek_v3_mtp")
    return {source: make_tiny_deepseek_v3(root / source, source=source, num_nextn_predict_layers=1)
            for source in ("block_fp8", "int4", "bf16")}


def weight_only_export(ckpt: Path, out: Path, recipe: str = W4A16) -> Path:
    """The model path without calibration data (load, quantize with no forward loop, export), one process."""
    import modelopt_k3

    model = modelopt_k3.load_pretrained(ckpt, progress=False)
    modelopt_k3.quantize(model, recipe, None, verbose=False)
    return modelopt_k3.export_checkpoint(model, out, progress=False)


def quantize_and_export(ckpt: Path, out: Path, recipe: str = RECIPE) -> Path:
    """Load, calibrate on ``calibration_token_ids()``, export (one process)."""
    import modelopt_k3

    model = modelopt_k3.load_pretrained(ckpt, progress=False)
    ids = calibration_token_ids()

    def loop(m):
        with torch.no_grad():
            m(input_ids=ids)

    modelopt_k3.quantize(model, recipe, loop, verbose=False)
    return modelopt_k3.export_checkpoint(model, out, progress=False)


@pytest.fixture(scope="session")
def deepseek_fp8_export(deepseek_fp8_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantize_and_export(deepseek_fp8_ckpt, tmp_path_factory.mktemp("deepseek_v3_export") / "export")
