"""Each report module's ``weight_algorithm``: what the run's calibrator recorded for that weight, not a name
guessed from the recipe. On the tiny Qwen3-MoE in process (one quantize per algorithm, about a second each),
and on the tiny Kimi-K3 whose MXFP4-sourced routed experts keep their lossless cast under every algorithm."""

from __future__ import annotations

import pytest
import torch

from modelopt_k3.quant.calibrators import weight_algorithm_names
from modelopt_k3.report import report
from modelopt_k3.report.render import markdown

pytestmark = pytest.mark.slow  # a few in-process quantizations of tiny models


@pytest.fixture(scope="module")
def qwen3_ckpt(tmp_path_factory):
    from modelopt_k3.testing.qwen3_moe import make_tiny_qwen3_moe

    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3") / "ckpt", seed=0)


def _quantized(ckpt, recipe, **load):
    import modelopt_k3
    from modelopt_k3.testing.qwen3_moe import calibration_token_ids

    model = modelopt_k3.load_pretrained(ckpt, progress=False, **load)
    ids = calibration_token_ids()

    def loop(m):
        with torch.no_grad():
            m(input_ids=ids)

    return modelopt_k3.quantize(model, recipe, loop, verbose=False)


def _algorithms(data) -> dict[str, str]:
    return {m["name"]: m["weight_algorithm"] for m in data["modules"] + data["experts"]}


# recipe -> (dense Linears, routed experts): local_hessian and gptq weight every expert by its own routed tokens
# (its owner's Hessian).
CASES = {
    "presets/nvfp4_default": ("max", "max"),
    "presets/nvfp4_default_mse": ("mse", "mse"),
    "presets/nvfp4_default_four_over_six": ("four_over_six", "four_over_six"),
    "presets/nvfp4_default_local_hessian": ("local_hessian", "local_hessian"),
    "presets/nvfp4_default_gptq": ("gptq", "gptq"),
}


@pytest.mark.parametrize("recipe", list(CASES))
def test_the_report_says_which_algorithm_set_each_weights_scales(recipe, qwen3_ckpt):
    model = _quantized(qwen3_ckpt, recipe)
    data = report(model, None)
    dense, experts = CASES[recipe]
    assert data["version"] == 2
    assert {m["weight_algorithm"] for m in data["modules"]} == {dense}
    assert {m["weight_algorithm"] for m in data["experts"]} == {experts}
    assert len(data["modules"]) == 15 and len(data["experts"]) == 6
    assert set(_algorithms(data).values()) <= set(weight_algorithm_names())
    # the calibrator's own record, under the quantizer names the report reads
    recorded = model.modelopt_k3_quant.weight_algorithms
    assert {n: recorded[n] for n in (m["name"] for m in data["modules"])} == \
        {m["name"]: m["weight_algorithm"] for m in data["modules"]}
    row = next(line for line in markdown(data).splitlines() if line.startswith("| `model.layers.1.mlp.down_proj`"))
    assert row.split("|")[3].strip() == dense


def test_the_report_reads_the_record_not_the_recipe(qwen3_ckpt):
    """Changing the calibrator's record for one weight changes that row only: nothing is re-derived by name."""
    model = _quantized(qwen3_ckpt, "presets/nvfp4_default_mse")
    name = "model.layers.0.self_attn.k_proj"
    model.modelopt_k3_quant.weight_algorithms[name] = "gptq"
    algorithms = _algorithms(report(model, None))
    assert algorithms.pop(name) == "gptq" and set(algorithms.values()) == {"mse"}
    del model.modelopt_k3_quant.weight_algorithms[name]
    assert _algorithms(report(model, None))[name] is None


def test_a_linear_without_a_hessian_is_recorded_as_the_plain_search():
    """local_hessian where a Linear has no Hessian (no calibration token reached it) runs
    mse's plain-error search there, and records that, not the recipe's method."""
    from modelopt_k3.quant.calibrators import calibrator_for
    from modelopt_k3.quant.modules import attach_linear
    from modelopt_k3.quant.schemes import NVFP4_TENSOR

    model = torch.nn.Sequential(torch.nn.Linear(32, 16, bias=False), torch.nn.Linear(16, 8, bias=False))
    for linear in model:
        attach_linear(linear, NVFP4_TENSOR, None, None)
    cal = calibrator_for("local_hessian")
    cal.hessians = {id(model[0]): torch.eye(16).expand(2, 16, 16).contiguous()}
    cal.finalize_weights(model)
    assert cal.weight_algorithms == {"0": "local_hessian", "1": "mse"}
    assert cal.labels["1"].endswith("plain-error search)")


@pytest.mark.parametrize("recipe", ["presets/nvfp4_mse", "presets/nvfp4"])
def test_mxfp4_sourced_experts_are_the_lossless_cast(recipe, tiny_ckpt):
    model = _quantized(tiny_ckpt, recipe, trust_remote_code=True)
    data = report(model, None)
    dense = "mse" if recipe.endswith("mse") else "max"
    assert {m["source"] for m in data["experts"]} == {"mxfp4"}
    assert {m["weight_algorithm"] for m in data["experts"]} == {"lossless_cast"}
    assert {m["weight_algorithm"] for m in data["modules"]} == {dense}
    assert "| lossless cast |" in markdown(data)
