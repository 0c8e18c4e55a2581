"""The expert-coverage guard on hand-built layer totals: ``--min_expert_tokens`` is the threshold (an
expert with 1 <= tokens < min is starved too, not only one no token reached), each policy's outcome."""

from __future__ import annotations

import pytest

from modelopt_k3.quant.coverage import CoverageError, LayerCoverage, check_coverage, uncovered_explanation

CALIBRATED = {"weight": "no calibration: from the weights' amax",
              "input": "calibrated: one input_scale per layer, the max over the tokens routed to any of its experts"}
FIXED = {"weight": "no calibration: from the weights' amax", "input": "no calibration: constant input_amax 4"}


def _layer(handled: list[int], dependence=CALIBRATED, *, calibrate_all: bool = False) -> LayerCoverage:
    return LayerCoverage("layers.1.mlp.experts", routed=list(handled), handled=list(handled),
                         calibrate_all=calibrate_all, dependence={"gate_up_proj": dependence},
                         input_scales={"gate_up_proj": 0.5})


def test_experts_below_min_tokens_are_starved_not_only_those_with_none():
    layer = _layer([0, 3, 4, 9])
    assert layer.uncovered(1) == [0]
    assert layer.uncovered(4) == [0, 1]  # 3 tokens < 4: starved; exactly 4 is enough
    assert layer.uncovered(10) == [0, 1, 2, 3]
    assert layer.uncovered(0) == []


def test_refuse_names_an_expert_with_some_but_too_few_tokens():
    layer = _layer([5, 2, 8, 7])  # every expert got tokens; expert 1 fewer than 4
    assert check_coverage([layer], min_tokens=2, policy="refuse") == []
    with pytest.raises(CoverageError, match=r"fewer than 4 calibration token\(s\).*experts \[1\] \(tokens \[2\]\)"):
        check_coverage([layer], min_tokens=4, policy="refuse")


def test_shared_and_fixed_inputs_note_the_starved_experts_with_the_threshold():
    layer = _layer([5, 2, 8, 7])
    (note,) = check_coverage([layer], min_tokens=4, policy="shared")
    assert "experts [1] got fewer than 4 calibration token(s)" in note and "shared input scale" in note
    fixed = _layer([5, 2, 8, 7], FIXED)
    (note,) = check_coverage([fixed], min_tokens=6, policy="refuse")  # nothing depends on data: no refusal
    assert "experts [0, 1] got fewer than 6" in note and "none of their scales depends on calibration" in note
    with pytest.raises(ValueError, match="uncovered-experts policy 'nope'"):
        check_coverage([layer], min_tokens=1, policy="nope")


def test_the_explanation_counts_the_other_experts_tokens():
    layer = _layer([5, 2, 8, 7])
    entry = uncovered_explanation(layer, 1, "shared")
    assert (entry["expert"], entry["routed"], entry["handled"]) == (1, 2, 2)
    assert "this expert saw 2 token(s), the layer's other experts 20 routed" in entry["scales"]["gate_up_proj"]["why"]
    everyone = _layer([5, 2, 8, 7], calibrate_all=True)
    assert "calibrated on all 2 tokens" in uncovered_explanation(everyone, 1, "calibrate_all")["scales"][
        "gate_up_proj"]["why"]


def test_hf_ptq_guard_passes_min_expert_tokens_on(monkeypatch):
    """hf_ptq's guard applies the flag's threshold, not the default 1 (expert 1 has 2 tokens, the flag asks 4)."""
    import argparse
    import types

    from modelopt_k3.cli import hf_ptq
    from modelopt_k3.quant import coverage

    layer = _layer([5, 2, 8, 7])
    monkeypatch.setattr(coverage, "expert_coverage", lambda model, spec, within=None: [layer])
    model = types.SimpleNamespace()
    said = []
    args = argparse.Namespace(min_expert_tokens=4, uncovered_experts="shared")
    assert hf_ptq._coverage_guard(args, model, None, said.append) == [layer]
    assert len(said) == 1 and "experts [1] got fewer than 4" in said[0]
    with pytest.raises(CoverageError, match=r"experts \[1\]"):
        hf_ptq._coverage_guard(argparse.Namespace(min_expert_tokens=4, uncovered_experts="refuse"), model, None,
                               said.append)


def test_tokens_are_counted_only_while_the_layers_input_quantizers_calibrate():
    """The pre-hook counts a forward's routed ids (global expert ids, top-k each) only in calibration: the
    held-out pass (quantizers ``quant``) and forwards with quantizers ``off`` add nothing."""
    import types

    import torch

    from modelopt_k3.quant.coverage import TokenCounter

    quantizer = types.SimpleNamespace(mode="calib")
    module = types.SimpleNamespace(quant=types.SimpleNamespace(input={"gate_up_proj": quantizer}))
    counter = TokenCounter(4)
    ids = torch.tensor([[0, 2], [2, 3], [2, 0]])  # 3 tokens, top-2
    counter(module, (torch.zeros(3, 8), ids, torch.ones(3, 2)), {})
    assert counter.routed.tolist() == [2, 0, 3, 1] and (counter.seen, counter.calls) == (3, 1)
    for mode in ("quant", "off"):
        quantizer.mode = mode
        counter(module, (torch.zeros(3, 8),), {"top_k_index": ids, "top_k_weights": torch.ones(3, 2)})
    assert counter.routed.tolist() == [2, 0, 3, 1] and (counter.seen, counter.calls) == (3, 1)
    quantizer.mode = "calib"
    counter(module, (torch.zeros(3, 8),), {"top_k_index": ids[:1], "top_k_weights": torch.ones(1, 2)})
    assert counter.routed.tolist() == [3, 0, 4, 1] and (counter.seen, counter.calls) == (4, 2)
