"""``nvfp4_act_headroom`` (quant/calibrators/act_headroom.py) against statistics computed by hand here: the
histogram of log2(per-16-block amax) (512 bins over [-40, 40], width 5/32, a percentile read at its bin's centre),
``amax = max(rho * anchor, upper)`` with ModelOpt 0.47's defaults, the anchor floor at upper / 1e6, the fallbacks;
then the handler on one Linear (its input amax is the rule's, weights are max's) and the config's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modelopt_k3.quant.calibrators import algorithm_config, calibrator_for
from modelopt_k3.quant.calibrators.act_headroom import (
    block_amax_counts,
    counts_percentile,
    headroom_amax,
)
from modelopt_k3.recipe.algorithm import AlgorithmError

WIDTH = 80 / 512  # one bin, in log2
# nvidia-modelopt 0.47.0's NVFP4ActHeadroomCalibrator amax on act_headroom_cases() (scripts/modelopt_golden_act_headroom.py)
GOLDEN = Path(__file__).resolve().parents[1] / "data" / "modelopt_0_47_act_headroom_golden.json"


def act_headroom_cases() -> dict[str, tuple[list[torch.Tensor], dict]]:
    """Activation batches (several per case: the statistic adds up over batches) and the options, by name."""
    def batches(seed: int, shape: tuple[int, ...], dtype=torch.float32, decades: float = 2.0, tail: float = 2.0,
                n: int = 3):
        g = torch.Generator().manual_seed(seed)
        spread = torch.logspace(-decades / 2, decades / 2, shape[-1])[torch.randperm(shape[-1], generator=g)]
        out = []
        for _ in range(n):
            x = torch.randn(shape, generator=g) * spread
            x[..., : shape[-1] // 8] *= torch.rand(shape[:-1] + (1,), generator=g) ** tail  # a tail of small blocks
            out.append(x.to(dtype))
        return out

    return {
        "defaults": (batches(0, (64, 256)), {}),
        "bf16_3d": (batches(1, (4, 32, 128), torch.bfloat16), {}),
        "rho_64_upper_wins": (batches(2, (64, 256)), {"rho": 64.0}),
        "upper_100": (batches(3, (32, 256), decades=6.0), {"upper_percentile": 100.0, "rho": 256.0}),
        "ragged_40": (batches(4, (96, 40)), {"anchor_percentile": 5.0}),
        "wide_spread": (batches(5, (128, 64), decades=8.0, tail=12.0), {"anchor_percentile": 0.5, "upper_percentile": 99.0}),
    }


def _blocks(*amaxes: float) -> torch.Tensor:
    """One 16-block per value, its amax that value (on a negative entry: amax takes |x|)."""
    x = torch.zeros(len(amaxes), 16)
    for i, a in enumerate(amaxes):
        x[i, i % 16] = -a if i % 2 else a
    return x


def _centre(log2_amax: float) -> float:
    """The centre of the bin holding ``2**log2_amax``, worked by hand: bin = floor((log2 + 40) / WIDTH)."""
    b = int((log2_amax + 40) // WIDTH)
    return 2.0 ** (-40 + (b + 0.5) * WIDTH)


def test_the_histogram_counts_each_nonzero_block_in_its_log2_bin():
    x = _blocks(1.0, 1.0, 1024.0, 0.0)  # the zero block is not counted
    counts = block_amax_counts(x)
    # log2 1 = 0 -> (0 + 40) / (5/32) = 256; log2 1024 = 10 -> 50 * 32/5 = 320
    assert counts.dtype == torch.int64 and int(counts.sum()) == 3
    assert counts[256] == 2 and counts[320] == 1
    # A ragged last dim is zero-padded, which changes no block's amax: 20 values = a block of 16 and one of 4.
    ragged = torch.zeros(1, 20)
    ragged[0, 18] = 2.0
    assert block_amax_counts(ragged)[262] == 1 and int(block_amax_counts(ragged).sum()) == 1  # log2 2 = 1 -> 262.4


def test_amax_is_rho_times_the_anchor_when_that_clears_the_upper_percentile():
    counts = block_amax_counts(_blocks(*[1.0] * 99, 1024.0))
    # anchor: 1% of 100 blocks = 1 -> the first bin reaching it, 1.0's (256); upper: 99.99 -> 1024's bin (320).
    assert counts_percentile(counts, 1.0) == _centre(0.0) == 2.0 ** (5 / 64)
    assert counts_percentile(counts, 99.99) == _centre(10.0) == 2.0 ** (10 + 5 / 64)
    amax, which = headroom_amax(counts, 1024.0, 1.0, 99.99, 16384.0)
    assert which == "headroom" and amax.dtype == torch.float32
    assert float(amax) == float(torch.tensor(16384.0 * 2.0 ** (5 / 64), dtype=torch.float32))
    # rho 512: 2**9 * anchor < upper, so the upper percentile is the amax; upper_percentile 100: the observed max.
    assert headroom_amax(counts, 1024.0, 1.0, 99.99, 512.0) == (torch.tensor(2.0 ** (10 + 5 / 64)), "upper")
    assert headroom_amax(counts, 1024.0, 1.0, 100.0, 512.0) == (torch.tensor(1024.0), "upper")


def test_the_anchor_ignores_blocks_below_upper_over_a_million():
    # 5 blocks at 2**-30 among 105: without the floor the 1st percentile would be theirs.
    counts = block_amax_counts(_blocks(*[2.0**-30] * 5, *[1.0] * 99, 1024.0))
    assert counts_percentile(counts, 1.0) == _centre(-30.0)
    upper = counts_percentile(counts, 99.99)
    assert upper == _centre(10.0)
    assert counts_percentile(counts, 1.0, upper / 1e6) == _centre(0.0)
    amax, _ = headroom_amax(counts, 1024.0, 1.0, 99.99, 16384.0)
    assert float(amax) == float(torch.tensor(16384.0 * _centre(0.0), dtype=torch.float32))
    # A block just above the floor counts: 2**-9 > 2**10.08 / 1e6 (about 2**-9.85).
    near = block_amax_counts(_blocks(*[2.0**-9] * 5, *[1.0] * 99, 1024.0))
    assert counts_percentile(near, 1.0, upper / 1e6) == _centre(-9.0)


def test_empty_statistics_fall_back_to_the_observed_max():
    empty = torch.zeros(512, dtype=torch.int64)
    assert counts_percentile(empty, 50.0) is None
    assert headroom_amax(empty, 3.0, 1.0, 99.99, 16384.0) == (torch.tensor(3.0), "max")


def _one_linear(x: torch.Tensor, algorithm):
    from modelopt_k3.quant.modules import attach_linear
    from modelopt_k3.quant.schemes import NVFP4_TENSOR

    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(x.shape[-1], 8, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(8, x.shape[-1], generator=g))
    attach_linear(model[0], NVFP4_TENSOR, NVFP4_TENSOR, None)

    def loop(m):
        with torch.no_grad():
            for part in x.chunk(3):  # several batches: the counts add up
                m(part)

    calibrator = calibrator_for(algorithm)
    calibrator.calibrate(model, loop, {})
    return model, calibrator


def test_the_calibrator_sets_the_input_amax_by_the_rule_and_leaves_weights_to_max():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 64, generator=g) * torch.logspace(-3, 1, 64)  # blocks over four decades
    model, calibrator = _one_linear(x, "nvfp4_act_headroom")
    baseline, _ = _one_linear(x, "max")
    q = model[0].input_quantizer
    want, which = headroom_amax(block_amax_counts(x), float(x.abs().max()), 1.0, 99.99, 16384.0)
    assert which == "headroom" and torch.equal(q.amax, want) and float(q.amax) > float(x.abs().max())
    assert float(baseline[0].input_quantizer.amax) == float(x.abs().max())
    assert torch.equal(model[0].weight_quantizer.amax, baseline[0].weight_quantizer.amax)
    assert calibrator.weight_algorithms == {"0": "max"} and q.mode == "quant"
    # A small rho gives no headroom: the 99.99th percentile, below the observed max (one block clipped).
    model, calibrator = _one_linear(x, {"method": "nvfp4_act_headroom", "rho": 2.0})
    want, which = headroom_amax(block_amax_counts(x), float(x.abs().max()), 1.0, 99.99, 2.0)
    assert which == "upper" and torch.equal(model[0].input_quantizer.amax, want)
    assert "no headroom" in calibrator.labels["0.input_quantizer"]


def test_the_config_takes_modelopts_defaults_and_refuses_what_it_cannot_run():
    config = algorithm_config("nvfp4_act_headroom")
    assert (config.anchor_percentile, config.upper_percentile, config.rho) == (1.0, 99.99, 16384.0)
    assert algorithm_config({"method": "nvfp4_act_headroom", "rho": 1024}).rho == 1024.0
    for bad, match in (({"rho": 28672.0}, "rho must be in"), ({"rho": 0.0}, "rho must be in"),
                       ({"anchor_percentile": 0.0}, "anchor_percentile must be in"),
                       ({"upper_percentile": 100.5}, "upper_percentile must be in"),
                       ({"weight_scale_algorithm": "mse"}, "has no option 'weight_scale_algorithm'")):
        with pytest.raises(AlgorithmError, match=match):
            algorithm_config({"method": "nvfp4_act_headroom", **bad})


def test_equals_modelopt_0_47_on_the_same_batches():
    """ModelOpt's own calibrator (its 0.47.0 files, run by the golden script) and ours give the same amax, bit for
    bit, on each case's batches; the cases cover headroom, upper, the observed max, bf16, a ragged last dim."""
    golden = json.loads(GOLDEN.read_text())
    assert golden["modelopt"] == "0.47.0" and set(golden["cases"]) == set(act_headroom_cases())
    which_seen = set()
    for name, (batches, options) in act_headroom_cases().items():
        assert golden["cases"][name]["options"] == options, name
        counts = sum(block_amax_counts(x) for x in batches)
        observed = float(max(x.abs().max().float() for x in batches))
        config = algorithm_config({"method": "nvfp4_act_headroom", **options})
        amax, which = headroom_amax(counts, observed, config.anchor_percentile, config.upper_percentile, config.rho)
        which_seen.add(which)
        assert float(amax) == float.fromhex(golden["cases"][name]["amax"]), (name, float(amax), golden["cases"][name])
    assert which_seen == {"headroom", "upper"}


def test_replicated_experts_calibrated_on_every_token_are_refused(monkeypatch):
    """calibrate_all_experts pushes every token through each replica of an expert block: the counts would be the
    one-process counts times the replicas, so the calibrator refuses before any forward (max does not mind)."""
    from types import SimpleNamespace

    from modelopt_k3.quant.calibrators import act_headroom
    from modelopt_k3.quant.modules import ExpertsQuantState

    experts = torch.nn.Module()
    experts.quant = ExpertsQuantState()
    experts.placement = SimpleNamespace(replicas="two ranks")
    model = torch.nn.Sequential(experts)
    monkeypatch.setattr(act_headroom.dist, "get_world_size", lambda group: 2 if group == "two ranks" else 1)
    assert act_headroom.recounted_experts(model) == []  # routed only: each token reaches one replica
    experts.quant.calibrate_all_experts = True
    assert act_headroom.recounted_experts(model) == ["0"]
    calls = []
    with pytest.raises(ValueError, match="0 pushes every token through every replica"):
        calibrator_for("nvfp4_act_headroom").observe(model, calls.append)
    assert calls == []
    experts.placement = SimpleNamespace(replicas=None)  # one copy of each expert: every token once
    assert act_headroom.recounted_experts(model) == []
