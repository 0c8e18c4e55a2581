"""AWQ's pure numerics (numerics/awq.py): the exact, split-independent ``mean|x|`` limbs, the scale rule, the grid,
and the probe that maps a consumer's input channels to a producer's output rows (the v->o / up->down folds)."""

from __future__ import annotations

import math

import pytest
import torch

from modelopt_k3.numerics.awq import (
    LIMB_BITS,
    LIMBS,
    TOP_EXP,
    abs_sum_limbs,
    alpha_grid,
    awq_scales,
    limbs_to_sum,
    probe_row_map,
    rows_of,
)


def _wide(rows: int, seed: int) -> torch.Tensor:
    """|x| over ~60 binades (2**-40 .. 2**19): a float64 running sum of it depends on the order."""
    g = torch.Generator().manual_seed(seed)
    mant = torch.rand(rows, 8, generator=g) + 0.5
    exps = torch.randint(-40, 19, (rows, 8), generator=g).float()
    sign = torch.where(torch.rand(rows, 8, generator=g) < 0.5, -1.0, 1.0)
    return sign * mant * torch.exp2(exps)


def test_limb_sums_are_the_same_bits_however_the_rows_are_split_or_ordered():
    x = _wide(600, 0)
    whole = abs_sum_limbs(x)
    assert whole.shape == (LIMBS, 8) and whole.dtype == torch.float64
    parts = sum(abs_sum_limbs(p) for p in x.split([1, 99, 200, 300]))  # as ranks / batches would split it
    shuffled = abs_sum_limbs(x[torch.randperm(600, generator=torch.Generator().manual_seed(1))])
    assert torch.equal(parts, whole) and torch.equal(shuffled, whole)
    assert torch.equal(whole, torch.round(whole)) and bool((whole < 2.0**53).all())  # integer-valued: exact
    # The float sum these replace is order-dependent on such data (what made them necessary) ...
    a = x.abs().double()
    assert not torch.equal(a.sum(0), a.flip(0).cumsum(0)[-1])
    # ... and their value is the exact sum (math.fsum: correctly rounded) to float64 rounding of the combine.
    for c in range(8):
        exact = math.fsum(a[:, c].tolist())
        assert abs(float(limbs_to_sum(whole)[c]) - exact) <= 4 * math.ulp(exact), c


def test_limbs_keep_values_down_to_their_last_grid_and_refuse_what_they_cannot_hold():
    tiny = 2.0 ** (TOP_EXP - LIMB_BITS * LIMBS)
    x = torch.tensor([[2.0**TOP_EXP - 1.0, tiny, tiny / 2]], dtype=torch.float64)
    total = limbs_to_sum(abs_sum_limbs(x))
    assert total.tolist() == [2.0**TOP_EXP - 1.0, tiny, 0.0]  # below the last grid: dropped, on every rank alike
    for bad in (2.0**TOP_EXP, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="awq"):
            abs_sum_limbs(torch.tensor([[1.0, bad]]))


def test_alpha_grid_is_modelopts_step_grid_over_0_1():
    assert alpha_grid(0.1) == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    assert alpha_grid(0.25) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert alpha_grid(1.0) == [0.0, 1.0]


def test_awq_scales_are_mean_to_alpha_normalised_to_straddle_one():
    mean = torch.tensor([0.5, 2.0, 8.0, 0.0], dtype=torch.float64)
    assert torch.equal(awq_scales(mean, 0.0), torch.ones(4))  # alpha 0: no smoothing, exactly
    s = awq_scales(mean, 0.5)
    floored = torch.tensor([0.5, 2.0, 8.0, 1e-4], dtype=torch.float64).sqrt()
    want = floored / torch.sqrt(floored.max() * floored.min())
    assert s.dtype == torch.float32 and torch.allclose(s.double(), want, rtol=1e-7, atol=0)
    assert math.isclose(float(s.max()) * float(s.min()), 1.0, rel_tol=1e-6)
    assert torch.allclose(awq_scales(mean, 1.0)[:3] / awq_scales(mean, 1.0)[0], torch.tensor([1.0, 4.0, 16.0]))


def test_block_normalised_row_sums_divide_each_block_by_its_amax_and_sum_the_rows():
    from modelopt_k3.numerics.awq import NORM_EPS, block_normalised_row_sums

    w = torch.tensor([[1.0, -2.0, 4.0, 0.0], [0.0, 0.0, -3.0, 1.5]])
    got = block_normalised_row_sums(w, 2)
    rows = [[1 / (2 + NORM_EPS), 2 / (2 + NORM_EPS), 4 / (4 + NORM_EPS), 0.0],
            [0.0, 0.0, 3 / (3 + NORM_EPS), 1.5 / (3 + NORM_EPS)]]
    assert got.dtype == torch.float64
    assert torch.allclose(got, torch.tensor(rows, dtype=torch.float64).sum(0), rtol=0, atol=1e-15)
    experts = torch.stack([w, 2 * w])  # one sum per expert; a block's scale cancels
    assert torch.allclose(block_normalised_row_sums(experts, 2)[1], got, rtol=1e-6)
    with pytest.raises(ValueError, match="multiple of the block"):
        block_normalised_row_sums(torch.ones(2, 3), 2)


def test_duo_scales_divide_by_the_weight_term_and_straddle_one():
    from modelopt_k3.numerics.awq import DUO_EPS

    x = torch.tensor([1.0, 4.0, 9.0, 0.0])
    wm = torch.tensor([0.5, 0.25, 1.0, 0.5], dtype=torch.float64)
    for alpha in (0.0, 0.5, 1.0):
        want = (x.double().clamp(min=1e-4) ** alpha / (wm ** (1 - alpha) + DUO_EPS)).clamp(min=1e-4)
        want = want / torch.sqrt(want.max() * want.min())
        assert torch.allclose(awq_scales(x, alpha, wm).double(), want, rtol=1e-6)
    assert not torch.equal(awq_scales(x, 0.0, wm), torch.ones(4))  # duo at alpha 0 still smooths: s ~ 1 / w


def _probe(activation, y: torch.Tensor):
    """``probe(c)``: ``activation`` of the producer's output ``y [tokens, rows]`` with its rows scaled by ``c``."""
    return lambda c: activation(y * c.to(y.dtype))


def _producer_output(rows: int, seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(16, rows, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_probe_maps_each_up_row_of_a_gated_product_wherever_the_model_keeps_it():
    """``act(gate) * up`` with gate and up concatenated (Qwen3's experts) or interleaved: the map is the up row of
    each channel, whatever the layout; the gate rows are no channel's."""
    silu = torch.nn.functional.silu
    y = _producer_output(64)
    chunked = probe_row_map(_probe(lambda t: silu(t[:, :32]) * t[:, 32:], y), 64)
    assert torch.equal(chunked, torch.arange(32, 64))
    interleaved = probe_row_map(_probe(lambda t: silu(t[:, 0::2]) * t[:, 1::2], y), 64)
    assert torch.equal(interleaved, torch.arange(1, 64, 2))


def test_probe_maps_gqas_repeated_channels_to_their_one_producer_row():
    """o_proj's input repeats each v row once per query head of its kv group (here 2 kv heads of 4 dims, 3 query
    heads each, the heads' order kv-major as transformers' repeat_kv): channel i maps to row (i // 12) * 4 + i % 4."""
    y = _producer_output(8)
    heads = lambda t: t.view(-1, 2, 1, 4).expand(-1, 2, 3, 4).reshape(-1, 24)  # noqa: E731
    row_map = probe_row_map(_probe(heads, y), 8)
    want = torch.tensor([(i // 12) * 4 + i % 4 for i in range(24)])
    assert torch.equal(row_map, want)
    sums, counts = rows_of(torch.arange(24, dtype=torch.float64).unsqueeze(0), row_map)
    assert torch.equal(counts, torch.full((8,), 3))
    assert torch.equal(sums[0], torch.stack([torch.arange(24, dtype=torch.float64)[want == r].sum() for r in range(8)]))


@pytest.mark.parametrize("name, activation", [
    ("relu squared (no gate: 4x, not 2x)", lambda t: torch.relu(t[:, 32:]) ** 2),
    ("GPT-OSS's up + 1", lambda t: (t[:, 1::2] + 1) * torch.sigmoid(t[:, 0::2])),
    ("a mix of rows", lambda t: t[:, :32] + t[:, 32:]),
    ("softmax over rows (attention's q/k)", lambda t: torch.softmax(t, dim=-1)),
    ("a channel that is always zero", lambda t: t[:, :32] * torch.zeros(1, 32).index_fill(1, torch.tensor([0]), 1)),
])
def test_probe_refuses_what_is_not_one_row_times_a_function_of_others(name, activation):
    assert probe_row_map(_probe(activation, _producer_output(64)), 64) is None, name


def test_probe_refuses_a_map_that_breaks_under_the_final_mixed_probe():
    """A clamp the doubling probes never reach but the 4x of the final probe does: refused, not folded."""
    y = _producer_output(64).float().clamp(-1, 1)
    clamped = lambda t: torch.nn.functional.silu(t[:, :32]) * t[:, 32:].clamp(-3.0, 3.0)  # noqa: E731
    assert probe_row_map(_probe(clamped, y), 64) is None
    assert probe_row_map(_probe(lambda t: torch.nn.functional.silu(t[:, :32]) * t[:, 32:], y), 64) is not None
