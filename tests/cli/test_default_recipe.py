"""The recipe a command uses without --recipe is the checkpoint's model's own: hf_ptq's ``--qformat`` name mapped
by the spec (``PtqConfig.recipe_name``, decided in the preflight with the spec), the converter's calibration-free
recipe (``cli._common.converter_recipe``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelopt_k3.cli._common import converter_recipe
from modelopt_k3.recipe import load_recipe
from modelopt_k3.run.plan import PtqConfig
from modelopt_k3.spec import SpecError, get_spec


def _ckpt(tmp_path: Path, model_type: str) -> Path:
    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    return d


@pytest.mark.parametrize(
    ("model_type", "qformat", "expected"),
    [
        ("kimi_k3", "nvfp4", "presets/nvfp4"),
        ("kimi_k3", "fp8", "presets/fp8"),
        ("qwen3_moe", "nvfp4", "presets/nvfp4_default"),  # attention NVFP4: its engines serve it
        ("qwen3_moe", "w4a16_nvfp4", "presets/w4a16_nvfp4"),
        ("gpt_oss", "nvfp4", "models/openai/gpt-oss/nvfp4"),
        ("kimi_k3", "presets/trtllm", "presets/trtllm"),  # not a --qformat name: a recipe name as given
        # An algorithm's nvfp4_<preset> (the calibrators' registry): the model's nvfp4 recipe's <recipe>_<preset>
        # where that file exists, else the generic presets/nvfp4_<preset> (DeepSeek-V3 has none of its own).
        ("qwen3_moe", "nvfp4_gptq", "presets/nvfp4_default_gptq"),
        ("qwen3_moe", "nvfp4_act_headroom", "presets/nvfp4_default_act_headroom"),
        ("gpt_oss", "nvfp4_four_over_six", "models/openai/gpt-oss/nvfp4_four_over_six"),
        ("gpt_oss", "nvfp4_act_headroom", "models/openai/gpt-oss/nvfp4_act_headroom"),
        ("kimi_k3", "nvfp4_mse", "presets/nvfp4_mse"),
        ("deepseek_v3", "nvfp4_local_hessian", "presets/nvfp4_local_hessian"),
        ("deepseek_v3", "nvfp4_act_headroom", "presets/nvfp4_act_headroom"),
    ],
)
def test_qformat_names_the_models_own_recipe(model_type, qformat, expected):
    got = PtqConfig(qformat=qformat).recipe_name(get_spec(model_type))
    assert got == expected
    load_recipe(got)  # every recipe a spec names exists and parses


def test_recipe_wins_over_qformat():
    assert PtqConfig(qformat="fp8", recipe="presets/trtllm").recipe_name(get_spec("qwen3_moe")) == "presets/trtllm"


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [("kimi_k3", "models/moonshotai/Kimi-K3/nvfp4_experts"), ("gpt_oss", "models/openai/gpt-oss/nvfp4_experts")],
)
def test_the_converter_default_is_the_models_calibration_free_recipe(tmp_path, model_type, expected):
    got = converter_recipe(_ckpt(tmp_path, model_type))
    assert got == expected
    load_recipe(got)


def test_the_converter_refuses_a_model_without_a_calibration_free_recipe(tmp_path):
    with pytest.raises(SpecError, match=r"qwen3_moe.*BF16.*--recipe"):
        converter_recipe(_ckpt(tmp_path, "qwen3_moe"))
