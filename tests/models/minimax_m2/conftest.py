"""The tiny block-FP8 MiniMax-M2 stand-in (hub names and source format), built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelopt_k3.testing import make_tiny


@pytest.fixture(scope="session")
def minimax_m2_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("minimax_m2", tmp_path_factory.mktemp("tiny_minimax_m2") / "ckpt")
