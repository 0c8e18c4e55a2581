"""Fixtures of the GPT-OSS tests: the tiny stand-in (built once per session) and transformers' own model of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelopt_k3.testing.tiny_gpt_oss import make_tiny_gpt_oss


@pytest.fixture(scope="session")
def tiny_gpt_oss_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A default-size tiny GPT-OSS checkpoint (seed 0). Do not modify it."""
    return make_tiny_gpt_oss(tmp_path_factory.mktemp("tiny_gpt_oss") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def gpt_oss_reference(tiny_gpt_oss_ckpt: Path) -> torch.nn.Module:
    """transformers' own ``GptOssForCausalLM.from_pretrained`` of the stand-in (its MXFP4 integration
    dequantizes the experts on CPU): the independent baseline, in bf16 as the checkpoint."""
    from transformers import GptOssForCausalLM

    model = GptOssForCausalLM.from_pretrained(tiny_gpt_oss_ckpt, dtype=torch.bfloat16)
    return model.eval()
