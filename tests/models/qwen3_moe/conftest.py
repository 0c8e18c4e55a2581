"""The tiny Qwen3-MoE stand-in (built once per session) and its one-process calibrated NVFP4 export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelopt_k3.testing.qwen3_moe import calibration_token_ids, make_tiny_qwen3_moe


@pytest.fixture(scope="session")
def qwen3_moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def qwen3_moe_outlier_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same sizes with ``outliers=True``: heavy-tailed weights and a few 20-100x input channels."""
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe_outliers") / "ckpt", seed=0, outliers=True)


def quantize_and_export(ckpt: Path, out: Path, recipe: str = "nvfp4_default") -> Path:
    """Load, calibrate on ``calibration_token_ids()`` (what the golden's ModelOpt run saw), export."""
    import modelopt_k3

    model = modelopt_k3.load_pretrained(ckpt, progress=False)
    ids = calibration_token_ids()

    def loop(m):
        with torch.no_grad():
            m(input_ids=ids)

    modelopt_k3.quantize(model, recipe, loop, verbose=False)
    return modelopt_k3.export_checkpoint(model, out, progress=False)


@pytest.fixture(scope="session")
def qwen3_moe_export(qwen3_moe_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantize_and_export(qwen3_moe_ckpt, tmp_path_factory.mktemp("qwen3_moe_export") / "export")
