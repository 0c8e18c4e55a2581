"""One load-dtype rule (``spec.config.load_dtype``) for the preflight, the memory layout, the converter and the
library load: transformers' ``dtype="auto"`` (the config's ``dtype``, legacy ``torch_dtype``), then a composite
config's text config, then bfloat16."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from modelopt_k3.spec import SpecError
from modelopt_k3.spec.config import load_dtype


@pytest.mark.parametrize("config, want", [
    ({"dtype": "float32"}, torch.float32),
    ({"torch_dtype": "float16"}, torch.float16),
    ({"dtype": "torch.bfloat16", "torch_dtype": "float32"}, torch.bfloat16),  # dtype wins, as transformers 5
    ({"text_config": {"torch_dtype": "float32"}}, torch.float32),
    ({"dtype": "float16", "text_config": {"dtype": "float32"}}, torch.float16),  # the top level first
    ({}, torch.bfloat16),
])
def test_the_rule(config, want) -> None:
    assert load_dtype(config) is want


def test_a_transformers_config_reads_as_its_config_json() -> None:
    config = AutoConfig.for_model("qwen3_moe", torch_dtype="float32")
    assert load_dtype(config) is load_dtype(config.to_dict()) is torch.float32


@pytest.mark.parametrize("name", ["float33", "int8"])
def test_a_dtype_torch_cannot_load_in_is_refused(name) -> None:
    with pytest.raises(SpecError, match=name):
        load_dtype({"dtype": name})


def test_every_stage_asks_the_one_rule() -> None:
    """No stage keeps a reading of its own (the four there were disagreed on precedence)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "modelopt_k3"
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert 'get("torch_dtype")' not in text or path.name == "config.py", path
