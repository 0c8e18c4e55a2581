"""NVFP4 block-scale searches never lose to max on degenerate inputs (issue 42, item 2): per block, a tie
keeps max's scale, an objective that cannot rank candidates (zero, subnormal, non-finite) keeps max's
scale, and tiny weights keep max's codes. Max's scale here is the amax rule (``nvfp4_block_scales``)."""

from __future__ import annotations

import pytest
import torch

from modelopt_k3.numerics import nvfp4_global_scale, nvfp4_quantize
from modelopt_k3.numerics.nvfp4 import nvfp4_block_scales
from modelopt_k3.numerics.nvfp4_search import (
    FOUR_OVER_SIX_MULTIPLIERS,
    linspace_multipliers,
    nvfp4_global_scale_46,
    nvfp4_multiplier_block_scales,
    nvfp4_sweep_block_scales,
)

MSE_MULTIPLIERS = linspace_multipliers(0.25, 4.0, 0.1)  # mse's default, starting below max's scale


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _weights(seed: int = 0, rows: int = 4, cols: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.logspace(-1, 1, cols)


def _hessian(seed: int, nb: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(nb, 16, 64, generator=g)
    return a @ a.transpose(1, 2) / 64


def _only_element(i: int, nb: int) -> torch.Tensor:
    """A Hessian that weighs one element of every block and ignores the rest."""
    h = torch.zeros(nb, 16, 16)
    h[:, i, i] = 1.0
    return h


def test_a_tie_across_every_candidate_keeps_max_scale_in_the_sweep():
    """Only element 1 is weighed, and it is far below every candidate's smallest step: every candidate's
    error is the same normal fp32 value (a true tie, not a zero objective); the sweep used to pick 2**-9."""
    w = torch.zeros(2, 16)
    w[:, 0] = torch.tensor([48.0, 30.0])  # the block amax: max's scales 8 and 5 under gs = 1
    w[:, 1] = 1e-4  # under 2**-9 / 4: code 0 at every candidate, error 1e-8 everywhere
    gs = torch.tensor(1.0)
    got = nvfp4_sweep_block_scales(w, gs, hessian=_only_element(1, 1))
    assert _bytes(got).tolist() == _bytes(nvfp4_block_scales(w, gs)).tolist()
    assert got.float().flatten().tolist() == [8.0, 5.0]


def test_a_tie_between_a_smaller_multiplier_and_max_keeps_max_scale():
    """Element 1 = 20 errs 4 at scale 8 (20/8 = 2.5, between codes 2 and 3) and 4 at scale 4 (20/4 = 5, between
    4 and 6): multiplier 0.5 ties max's 1.0 and comes first; max's scale is kept."""
    w = torch.zeros(1, 16)
    w[0, 0], w[0, 1] = 48.0, 20.0
    gs = torch.tensor(1.0)
    got = nvfp4_multiplier_block_scales(w, gs, (0.5, 1.0), hessian=_only_element(1, 1))
    assert float(got.float()) == 8.0
    # A larger tying candidate too: 2.0 (scale 16, 20/16 = 1.25 -> 16 or 24) errs 4 as well.
    assert float(nvfp4_multiplier_block_scales(w, gs, (0.5, 2.0), hessian=_only_element(1, 1)).float()) == 8.0
    w[0, 1] = 24.0  # exact at scale 8 (code 3) and scale 4 (code 6): zero error, unrankable: max's
    assert float(nvfp4_multiplier_block_scales(w, gs, (0.5,), hessian=_only_element(1, 1)).float()) == 8.0


def test_a_strictly_better_candidate_still_replaces_max_scale():
    """21 errs 9 at max's scale 8 (21/8 -> code 3); scale 7 represents it exactly: a clear winner is taken."""
    w = torch.zeros(1, 16)
    w[0, 0], w[0, 1] = 48.0, 21.0
    gs = torch.tensor(1.0)
    got = float(nvfp4_sweep_block_scales(w, gs, hessian=_only_element(1, 1)).float())
    assert got != 8.0
    assert min(abs(21.0 - got * c) for c in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) == 0.0


@pytest.mark.parametrize("search", ["sweep", "multiplier"])
def test_a_zero_hessian_block_keeps_max_scale_and_the_others_are_unchanged(search):
    """All-zero calibration inputs on one block's features: its Hessian is 0, every candidate's error 0; it
    used to get the smallest candidate (every block scale 2**-9 for the sweep: relative RMS error 1.0)."""
    w = _weights(1, rows=16)
    gs = nvfp4_global_scale(w.abs().amax())
    h = _hessian(2, 2)
    h_zero = h.clone()
    h_zero[0] = 0.0

    def run(hessian):
        if search == "sweep":
            return nvfp4_sweep_block_scales(w, gs, hessian=hessian)
        return nvfp4_multiplier_block_scales(w, gs, MSE_MULTIPLIERS, hessian=hessian)

    got, full = run(h_zero), run(h)
    assert torch.equal(_bytes(got[:, 0]), _bytes(nvfp4_block_scales(w, gs)[:, 0]))
    assert torch.equal(_bytes(got[:, 1]), _bytes(full[:, 1]))  # the weighted block: as before
    assert not torch.equal(_bytes(full[:, 1]), _bytes(nvfp4_block_scales(w, gs)[:, 1]))  # the search mattered there
    every_zero = run(torch.zeros(2, 16, 16))
    assert torch.equal(_bytes(every_zero), _bytes(nvfp4_block_scales(w, gs)))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_objective_keeps_max_scale(bad):
    """A Hessian entry that is NaN or inf (an overflowed input moment): the block's error at max's scale is not
    finite, so its candidates cannot be ranked; max's scale is kept (as before: every candidate's error is NaN or
    inf here too; ``test_an_overflowing_error_keeps_max_scale`` is the case that changed)."""
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 48.0, 21.0
    w[0, 16:] = _weights(3, rows=1, cols=16)
    gs = torch.tensor(1.0)
    h = _hessian(4, 2)
    h[0] = 0.0
    h[0, 1, 1] = bad
    h[0, 0, 0] = 1.0
    for got in (nvfp4_sweep_block_scales(w, gs, hessian=h), nvfp4_multiplier_block_scales(w, gs, MSE_MULTIPLIERS, h)):
        assert float(got[0, 0].float()) == 8.0
        assert float(got[0, 1].float()) > 0  # the finite block is searched


def test_an_overflowing_error_keeps_max_scale():
    """A finite Hessian large enough that the error at max's scale overflows fp32 to inf while another scale's is
    finite: the objective is not trusted there (the sweep used to pick the finite candidate)."""
    w = torch.zeros(1, 16)
    w[0, 0], w[0, 1] = 48.0, 21.0
    h = torch.zeros(1, 16, 16)
    h[0, 1, 1] = 3e38
    got = nvfp4_sweep_block_scales(w, torch.tensor(1.0), hessian=h)
    assert float(got.float()) == 8.0


@pytest.mark.parametrize("scale", [1e-39, 1e-30, 1e-21])
@pytest.mark.parametrize("search", ["sweep", "mse", "four_over_six"])
@pytest.mark.parametrize("weighted", [False, True])
def test_subnormal_or_tiny_weights_keep_max_codes(scale, search, weighted):
    """fp32-subnormal weights (1e-39) and weights whose squared errors underflow (1e-30): every candidate's
    error is 0, and the first candidate used to win (2**-9 for the sweep, 0.25 x amax for mse's default
    multipliers), zeroing or shrinking the weight. At 1e-21 the errors are fp32-subnormal, too coarse to rank
    (four-over-six's x1.5 used to win there). Each keeps max's scale, so the export's codes are max's."""
    w = _weights(5) * scale
    h = _hessian(6, 2) if weighted else None
    if search == "four_over_six":
        gs = nvfp4_global_scale_46(w.abs().amax())
        got = nvfp4_multiplier_block_scales(w, gs, FOUR_OVER_SIX_MULTIPLIERS, hessian=h)
    else:
        gs = nvfp4_global_scale(w.abs().amax())
        got = (nvfp4_sweep_block_scales(w, gs, hessian=h) if search == "sweep"
               else nvfp4_multiplier_block_scales(w, gs, MSE_MULTIPLIERS, hessian=h))
    assert float(gs) > 0
    want = nvfp4_quantize(w, gs, block_scale=nvfp4_block_scales(w, gs))
    out = nvfp4_quantize(w, gs, block_scale=got)
    assert torch.equal(_bytes(out.block_scale), _bytes(want.block_scale))
    assert torch.equal(out.packed, want.packed)
    assert bool((want.packed != 0).any())  # max's codes are not all zero: keeping them matters
