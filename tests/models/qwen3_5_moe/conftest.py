"""The tiny Qwen3.5-MoE VLM stand-in (built once per session) and its one-process calibrated NVFP4 export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelopt_k3.testing.qwen3_5_moe import calibration_token_ids, make_tiny_qwen3_5_moe

RECIPE = "models/Qwen/Qwen3.5-MoE/nvfp4"


@pytest.fixture(scope="session")
def qwen3_5_moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_5_moe(tmp_path_factory.mktemp("tiny_qwen3_5_moe") / "ckpt", seed=0)


def quantize_and_export(ckpt: Path, out: Path, recipe: str = RECIPE) -> Path:
    """Load, calibrate on ``calibration_token_ids()``, export."""
    import modelopt_k3

    model = modelopt_k3.load_pretrained(ckpt, progress=False)
    ids = calibration_token_ids()

    def loop(m):
        with torch.no_grad():
            m(input_ids=ids)

    modelopt_k3.quantize(model, recipe, loop, verbose=False)
    return modelopt_k3.export_checkpoint(model, out, progress=False)


@pytest.fixture(scope="session")
def qwen3_5_moe_export(qwen3_5_moe_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantize_and_export(qwen3_5_moe_ckpt, tmp_path_factory.mktemp("qwen3_5_moe_export") / "export")
