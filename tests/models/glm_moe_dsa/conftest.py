"""The tiny GLM-5 stand-in (hub layout, one MTP layer, the DSA indexer selecting 4 of 32 tokens), built once."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelopt_k3.testing import make_tiny


@pytest.fixture(scope="session")
def glm_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("glm_moe_dsa", tmp_path_factory.mktemp("tiny_glm_moe_dsa") / "ckpt")
