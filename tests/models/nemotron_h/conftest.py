"""The tiny Nemotron-H stand-in (built once per session) and its one-process calibrated NVFP4 export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelopt_k3.testing.nemotron_h import calibration_token_ids, make_tiny_nemotron_h

# A latent width (48) other than the experts' intermediate width (32): up_proj [I, L] and down_proj [L, I] then
# have different shapes, so a transposed or swapped expert weight cannot pass.
SIZES = {"moe_latent_size": 48}
RECIPE = "models/nvidia/Nemotron-3/nvfp4_experts"


def calibration_ids() -> torch.Tensor:
    return calibration_token_ids(num=4, seq=32)


@pytest.fixture(scope="session")
def nemotron_h_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_nemotron_h(tmp_path_factory.mktemp("tiny_nemotron_h") / "ckpt", seed=0, **SIZES)


def quantize_and_export(ckpt: Path, out: Path, recipe: str = RECIPE) -> Path:
    """Load, calibrate on ``calibration_ids()`` in one forward, export."""
    import modelopt_k3

    model = modelopt_k3.load_pretrained(ckpt, progress=False)

    def loop(m):
        with torch.no_grad():
            m(input_ids=calibration_ids())

    modelopt_k3.quantize(model, recipe, loop, verbose=False)
    return modelopt_k3.export_checkpoint(model, out, progress=False)


@pytest.fixture(scope="session")
def nemotron_h_export(nemotron_h_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantize_and_export(nemotron_h_ckpt, tmp_path_factory.mktemp("nemotron_h_export") / "export")
