"""The INT4 -> NVFP4 question (docs/decisions/0027-deepseek-v3.md): which INT4 values NVFP4 holds exactly, and
the error of the two casts, measured on INT4 weights made the way a symmetric group-32 quantizer makes them."""

from __future__ import annotations

import torch

from modelopt_k3.numerics import (
    e2m1_round,
    int4_pack,
    int4_packed_decode,
    nvfp4_fake_quant,
    nvfp4_global_scale,
)
from modelopt_k3.numerics.e2m1 import e2m1_decode

CODES = torch.arange(-8, 8).float()


def _on_grid(step: float) -> dict[int, float]:
    """INT4 code -> its value on the E2M1 grid of one block whose scale is ``step`` INT4 units (exact scale)."""
    return {int(q): float(e2m1_decode(e2m1_round(q / step)) * step) for q in CODES}


def test_which_int4_codes_e2m1_holds_exactly():
    """A block scale of one INT4 step holds 0, ±1, ±2, ±3, ±4, ±6 (not ±5, ±7, -8); of two steps it holds
    0, ±1, ±2, ±3, ±4, ±6 and -8 (not ±5, ±7, which land one step off). No block scale holds all 16 codes:
    5 and 7 and 1 (or 3) cannot share one E2M1 grid (their ratios 5/1, 7/1, 7/3 are no ratios of E2M1 values)."""
    one, two = _on_grid(1.0), _on_grid(2.0)
    assert {q for q, v in one.items() if v == q} == {0, 1, -1, 2, -2, 3, -3, 4, -4, 6, -6}
    assert {q for q, v in two.items() if v == q} == {0, 1, -1, 2, -2, 3, -3, 4, -4, 6, -6, -8}
    assert all(abs(two[q] - q) == 1 for q in (5, -5, 7, -7))
    grid = {abs(v) for v in e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist() if v}
    ratios = {a / b for a in grid for b in grid}
    assert 5.0 not in ratios and 7.0 not in ratios and 7 / 3 not in ratios


def _int4_weights(rows: int = 1024, cols: int = 1024):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(rows, cols, generator=g) / 32
    groups = w.unflatten(-1, (-1, 32))
    scale = (groups.abs().amax(-1) / 7).bfloat16()
    q = torch.round(groups / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int8).flatten(-2)
    return w, q, scale, int4_packed_decode(int4_pack(q), scale, dtype=torch.float32)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_int4_to_nvfp4_error_measured():
    """Max-calibrated NVFP4 of the decoded INT4 weights (ModelOpt's rule: block amax -> 6): the block's 7 lands on
    6 and every other code on 6q/7, so besides zeros almost nothing stays exact; relative error ~0.10, as large as
    the INT4 source's own error against the weights it came from. The scale-2-steps cast (block scale 2s rounded
    to E4M3) is hardly better (~0.096): the bf16 group scales have 8 significant bits, E4M3 4."""
    w, q, scale, x = _int4_weights()
    y = nvfp4_fake_quant(x, nvfp4_global_scale(x.abs().amax()))
    nonzero = q != 0
    exact = (y == x)[nonzero].float().mean().item()
    assert exact < 0.03, exact
    assert 0.09 < _rel(y, x) < 0.115, _rel(y, x)
    assert 0.09 < _rel(x, w) < 0.105, _rel(x, w)
    g = 2 * scale.float().max() / 448
    step = ((2 * scale.float() / g).to(torch.float8_e4m3fn).float() * g).repeat_interleave(32, -1)
    cast = e2m1_decode(e2m1_round(x / step)) * step
    assert 0.085 < _rel(cast, x) < 0.105, _rel(cast, x)
    assert ((cast == x)[nonzero].float().mean().item()) < 0.03
