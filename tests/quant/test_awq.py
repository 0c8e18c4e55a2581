"""``awq``'s config and handler refusals (quant/calibrators/awq.py); the algorithm on models is tested on the tiny
stand-ins (tests/models/qwen3_moe/test_awq.py, tests/models/gpt_oss/test_awq.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from modelopt_k3.quant.calibrators import algorithm_config, calibrator_for, qformat_presets
from modelopt_k3.recipe.algorithm import AlgorithmError


def test_awq_options_presets_and_refusals():
    assert algorithm_config({"method": "awq", "then": "gptq"}).then_algorithm() == qformat_presets()["nvfp4_gptq"][1]
    assert algorithm_config("awq").then_algorithm() == "max"
    assert algorithm_config(qformat_presets()["nvfp4_awq_gptq"][1]).then == "gptq"
    assert algorithm_config(qformat_presets()["nvfp4_awq"][1]) == algorithm_config(
        {"method": "awq", "duo_scaling": True, "inputs": "act_headroom"})
    assert algorithm_config("awq").duo_scaling is False  # the bare method: ModelOpt awq_lite's rule
    assert algorithm_config("awq").inputs == "max"  # ... and its inputs: then's max
    for bad in ({"then": "mse"}, {"alpha_step": 0.0}, {"alpha_step": 1.5}, {"pre_quant_scale": True},
                {"duo_scaling": "yes"}, {"inputs": "mse"}):
        with pytest.raises(AlgorithmError, match="awq"):
            algorithm_config({"method": "awq", **bad})


def test_the_duo_search_starts_with_no_smoothing_then_every_alpha_duo():
    plain = algorithm_config({"method": "awq", "alpha_step": 0.5}).candidates()
    duo = algorithm_config({"method": "awq", "alpha_step": 0.5, "duo_scaling": True}).candidates()
    assert plain == [(0.0, False), (0.5, False), (1.0, False)]
    assert duo == [(0.0, False), (0.0, True), (0.5, True), (1.0, True)]


def test_awq_state_is_its_limb_sums_plus_what_then_holds():
    plain, both = algorithm_config("awq"), algorithm_config({"method": "awq", "then": "gptq"})
    gptq = algorithm_config(qformat_presets()["nvfp4_gptq"][1])
    assert plain.state_bytes(32, 64, 2) == (32 * 64, 0)
    held, kept = gptq.state_bytes(32, 64, 2)
    assert both.state_bytes(32, 64, 2) == (held + 32 * 64, kept)


def test_awq_refuses_what_it_cannot_fold():
    """Without calibration data, and under layerwise (a decoder layer handed over alone: its norms would be written
    before the export learned they changed)."""
    layer = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(ValueError, match="needs calibration data"):
        calibrator_for("awq").calibrate(layer, None, {})
    with pytest.raises(ValueError, match="layerwise is not built"):
        calibrator_for("awq").calibrate(layer, lambda m: m(torch.zeros(1, 16)), {})


def test_the_summary_counts_input_labels_as_input_scales():
    """A calibrator labels weights by the weight's name and an input rule's exceptions by the input quantizer's
    (nvfp4_act_headroom, awq's ``inputs``): the run's summary says which are which."""
    from modelopt_k3.quant.api import QuantPlan
    from modelopt_k3.quant.decisions import DecisionTable
    from modelopt_k3.recipe import load_recipe

    recipe = load_recipe("presets/nvfp4_default_awq")
    plan = QuantPlan(recipe, DecisionTable(recipe, {}), load=None, calibration={
        "model.layers.0.self_attn.q_proj": "awq (folded), then max",
        "model.layers.0.self_attn.q_proj.input_quantizer": "nvfp4_act_headroom after awq (no headroom at this rho)",
        "model.layers.0.mlp.experts.quant.input.gate_up_proj": "nvfp4_act_headroom after awq (no headroom at this rho)"})
    lines = plan.summary().splitlines()
    assert "  weight scales:      1 by awq (folded), then max" in lines
    assert "  input scales:      2 by nvfp4_act_headroom after awq (no headroom at this rho)" in lines
