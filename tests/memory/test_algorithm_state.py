"""The planner counts what a weight algorithm holds: its input sums through its forwards, and per weight
what it keeps until the export (GPTQ's updated copy, the searched block scales), checked against a real
run on the tiny Qwen3-MoE (every expert calibrated on every token, so each one holds its sums)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelopt_k3.memory.inventory import read_layout
from modelopt_k3.memory.planner import Asked, RunShape, estimate_asked
from modelopt_k3.recipe import load_recipe

pytestmark = pytest.mark.slow

ONE_PASS_GPTQ = {"method": "gptq", "perc_damp": 0.01, "block_size": 128}  # every Hessian in one forward
RECIPES = {
    "mse": ("presets/nvfp4_default_mse", None),
    "local_hessian": ("presets/nvfp4_default_local_hessian", None),
    "gptq": ("presets/nvfp4_default_gptq", ONE_PASS_GPTQ),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    from modelopt_k3.testing.qwen3_moe import make_tiny_qwen3_moe

    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("q3") / "q3")


def _recipe(name: str):
    preset, algorithm = RECIPES[name]
    overrides = {"calibrate_all_experts": True} | ({"algorithm": algorithm} if algorithm else {})
    return load_recipe(preset, overrides=overrides)


def _measured(ckpt: Path, recipe, monkeypatch) -> tuple[int, int, dict[str, int]]:
    """(bytes of every input-sum accumulator the run filled, plus local_hessian's fp32 Hessians; bytes each
    weight quantizer holds for the export: updated weight and block scales; those by decoder layer)."""
    import modelopt_k3
    from modelopt_k3.quant.calibrators import moments
    from modelopt_k3.quant.modules import iter_quantizers
    from modelopt_k3.testing.qwen3_moe import calibration_token_ids

    seen: dict[int, moments.Accumulator] = {}
    add = moments.Accumulator.add

    def recording(self, x):
        seen[id(self)] = self
        add(self, x)

    monkeypatch.setattr(moments.Accumulator, "add", recording)
    model = modelopt_k3.load_pretrained(ckpt, progress=False)

    def loop(m):
        with torch.no_grad():
            m(input_ids=calibration_token_ids())

    modelopt_k3.quantize(model, recipe, loop, verbose=False)
    sums = sum(a.hh.nbytes + a.hl.nbytes for a in seen.values())
    if recipe.algorithm.method == "local_hessian":
        sums += sum(a.hh.nbytes // 2 for a in seen.values())  # the fp32 E[x xᵀ] of each
    by_layer: dict[str, int] = {}
    for qname, q in iter_quantizers(model):
        layer = ".".join(qname.split(".")[:3])  # model.layers.N
        by_layer[layer] = by_layer.get(layer, 0) + sum(t.nbytes for t in (q.updated_weight, q.block_scale)
                                                       if t is not None)
    return sums, sum(by_layer.values()), by_layer


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_planner_counts_the_weight_algorithms_state(ckpt, name, monkeypatch):
    recipe = _recipe(name)
    est = estimate_asked(read_layout(ckpt), Asked("whole", "replicated", "bf16", 1), RunShape(device="cpu"),
                         recipe=recipe)
    sums, kept, by_layer = _measured(ckpt, recipe, monkeypatch)
    assert (est.algorithm_sums, est.algorithm_weights) == (sums, kept)
    assert kept > 0 and (sums > 0) == (name != "mse")
    plain = estimate_asked(read_layout(ckpt), Asked("whole", "replicated", "bf16", 1), RunShape(device="cpu"),
                           recipe=load_recipe("presets/nvfp4_default", overrides={"calibrate_all_experts": True}))
    assert est.stages["calibration"] - plain.stages["calibration"] == sums + kept
    assert est.stages["export"] - plain.stages["export"] == kept
    layerwise = estimate_asked(read_layout(ckpt), Asked("whole", "replicated", "bf16", 1),
                               RunShape(device="cpu", layerwise=True), recipe=recipe)
    assert layerwise.algorithm_weights == max(by_layer.values())  # one decoder layer at a time (the largest)


def test_a_layerwise_plan_counts_what_lies_outside_the_layers_once(ckpt):
    """Only ``lm_head`` quantized (outside every decoder layer): a layerwise run holds its state alone."""
    from modelopt_k3.recipe import recipe_from_dict

    recipe = recipe_from_dict({"algorithm": {"method": "mse", "fp8_scale_sweep": True},
                               "quant_cfg": [{"pattern": "*", "enable": False},
                                             {"pattern": "lm_head", "weights": "nvfp4", "inputs": None}]},
                              name="lm_head-mse")
    layout = read_layout(ckpt)
    head = next(t for t in layout.dense if t.name == "lm_head.weight")
    for layerwise in (False, True):
        est = estimate_asked(layout, Asked("whole", "replicated", "bf16", 1),
                             RunShape(device="cpu", layerwise=layerwise), recipe=recipe)
        assert (est.algorithm_sums, est.algorithm_weights) == (0, head.numel // 16), layerwise
