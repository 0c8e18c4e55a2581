"""The tiny Kimi-K2.5 stand-in (hub layout, INT4 experts, MoonViT; built once per session through the registry)
and its one-process calibrated NVFP4 export."""

from __future__ import annotations

from pathlib import Path

import pytest

PTQ = ["--qformat", "nvfp4", "--calib_size", "4", "--batch_size", "2", "--calib_seq", "24", "--no_progress"]


@pytest.fixture(scope="session")
def kimi_k25_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from modelopt_k3.testing import make_tiny

    return make_tiny("kimi_k25", tmp_path_factory.mktemp("tiny_kimi_k25") / "ckpt")


def ptq(*argv) -> int:
    """modelopt-k3-ptq --qformat nvfp4 on the calibration sizes above (``argv``: the rest)."""
    from modelopt_k3.cli import hf_ptq

    return hf_ptq.run(hf_ptq.build_parser().parse_args([*PTQ, *map(str, argv)]))


@pytest.fixture(scope="session")
def kimi_k25_export(kimi_k25_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kimi_k25_export") / "nvfp4"
    assert ptq("--pyt_ckpt_path", kimi_k25_ckpt, "--export_path", out, "--report", "none",
               "--target_engines", "vllm") in (0, 1)  # 1: an engine refuses (the verdicts are tested on their own)
    return out
