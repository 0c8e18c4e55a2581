"""numerics/gptq.py ``nvfp4_gptq_batched``: same-shape experts in one pass equal the per-expert loop bit for bit,
random and degenerate experts mixed in one batch (each expert's fallback its own)."""

from __future__ import annotations

import pytest
import torch

from modelopt_k3.numerics import nvfp4_block_scales, nvfp4_fake_quant, nvfp4_global_scale
from modelopt_k3.numerics.gptq import (
    gptq_batch_bytes,
    gptq_hessian_inverse,
    gptq_hessian_inverse_batched,
    nvfp4_gptq,
    nvfp4_gptq_batched,
)


def _experts(n_exp: int, out_f: int, in_f: int, seed: int, kinds: tuple[str, ...] = ()) -> tuple:
    """Weights ``[E, out, in]`` (bf16 values, an outlier column), Hessians ``2/n X^T X`` of a few hundred tokens
    with outlier channels, per-expert global scales and max's block scales. ``kinds[e]`` makes expert ``e``
    degenerate: ``dead`` (zero weight columns), ``nonpd`` (an indefinite Hessian), ``zero`` (a zero Hessian),
    ``lowrank`` (fewer tokens than inputs: damping alone makes it PD), ``zero_weight``."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_exp, out_f, in_f, generator=g).bfloat16().float()
    w[:, :, 3] *= 8
    tokens = torch.randn(n_exp, 3 * in_f, in_f, generator=g)
    tokens[:, :, 1] *= 20
    h = 2 * tokens.transpose(1, 2) @ tokens / tokens.shape[1]
    for e, kind in enumerate(kinds):
        if kind == "dead":
            w[e, :, 5:21] = 0  # a whole NVFP4 block of dead inputs and one more column
            w[e, :, in_f - 1] = 0
        elif kind == "nonpd":
            h[e] -= 4 * torch.eye(in_f) * h[e].diagonal().max()
        elif kind == "zero":
            h[e] = 0
        elif kind == "lowrank":
            few = tokens[e, :2]
            h[e] = 2 * few.T @ few / 2
        elif kind == "zero_weight":
            w[e] = 0
        elif kind:
            raise AssertionError(kind)
    gs = torch.stack([nvfp4_global_scale(w[e].abs().amax()) for e in range(n_exp)])
    bs = torch.stack([nvfp4_block_scales(w[e], gs[e]) for e in range(n_exp)])
    return w, h, gs, bs


def _loop(w, h, gs, bs, block_size: int) -> torch.Tensor:
    return torch.stack([nvfp4_gptq(w[e], h[e], gs[e], bs[e], 0.01, block_size) for e in range(w.shape[0])])


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    differ = got.view(torch.int32) != want.view(torch.int32)  # bit patterns: -0.0 and NaN count too
    assert not bool(differ.any()), f"{int(differ.sum())} of {differ.numel()} values differ"


@pytest.mark.parametrize(("n_exp", "out_f", "in_f", "block_size"), [
    (1, 8, 16, 16), (3, 24, 64, 16), (5, 32, 96, 32), (4, 48, 128, 128), (6, 16, 160, 64), (2, 40, 272, 128),
])
def test_batched_equals_the_per_expert_loop_bit_for_bit(n_exp, out_f, in_f, block_size):
    w, h, gs, bs = _experts(n_exp, out_f, in_f, seed=in_f + n_exp)
    got = nvfp4_gptq_batched(w, h, gs, bs, 0.01, block_size)
    want = _loop(w, h, gs, bs, block_size)
    _assert_bitwise(got, want)
    assert not torch.equal(got, torch.stack([nvfp4_fake_quant(w[e], gs[e], block_scale=bs[e])
                                              for e in range(n_exp)]))  # GPTQ moved something


@pytest.mark.parametrize("block_size", [16, 128])
def test_degenerate_experts_take_their_own_fallback_inside_one_batch(block_size):
    """Dead columns, an indefinite and a zero Hessian, a low-rank one and an all-zero weight, between ordinary
    experts: each equals its loop result, and only the not-PD ones fall back to the identity."""
    kinds = ("", "dead", "nonpd", "", "zero", "lowrank", "zero_weight", "dead")
    w, h, gs, bs = _experts(len(kinds), 24, 96, seed=7, kinds=kinds)
    inv = gptq_hessian_inverse_batched(h, w, 0.01)
    for e in range(len(kinds)):
        _assert_bitwise(inv[e], gptq_hessian_inverse(h[e], w[e], 0.01))
    eye = torch.eye(96)
    fell_back = [e for e in range(len(kinds)) if torch.equal(inv[e], eye)]
    assert fell_back == [2, 4], fell_back  # not PD (a zero weight's columns are all dead: H = 1.01 I, no fallback)
    _assert_bitwise(nvfp4_gptq_batched(w, h, gs, bs, 0.01, block_size), _loop(w, h, gs, bs, block_size))


def test_a_fallback_expert_rounds_plainly_and_leaves_its_neighbours_alone():
    """The identity factor is plain rounding under max's scales; the experts beside it get what they get alone."""
    kinds = ("", "nonpd", "")
    w, h, gs, bs = _experts(3, 16, 64, seed=11, kinds=kinds)
    got = nvfp4_gptq_batched(w, h, gs, bs, 0.01, 32)
    _assert_bitwise(got[1], nvfp4_fake_quant(w[1], gs[1], block_scale=bs[1]))
    for e in (0, 2):
        _assert_bitwise(got[e:e + 1], nvfp4_gptq_batched(w[e:e + 1], h[e:e + 1], gs[e:e + 1], bs[e:e + 1], 0.01, 32))


def _factor_but_no_inverse_factor(n: int) -> torch.Tensor:
    """A rank-deficient Gram matrix plus a tiny diagonal whose fp32 Cholesky succeeds while that of its computed
    inverse fails. Which seed and diagonal do so depends on the host's LAPACK (MKL takes other paths on Intel than
    on AMD), so the first that does on this host is taken rather than one fixed pair."""
    for seed in range(64):
        a = torch.randn(n, n - 2, generator=torch.Generator().manual_seed(seed))
        for eps in (1e-9, 1e-8, 1e-7, 3e-7, 1e-6, 3e-6, 1e-5):
            near = a @ a.T + torch.eye(n) * eps
            lower, info = torch.linalg.cholesky_ex(near)
            if int(info) == 0 and int(torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)[1]):
                return near
    raise AssertionError("no nearly singular Hessian whose inverse has no Cholesky factor on this host")


def test_an_expert_whose_inverse_has_no_factor_falls_back_alone():
    """Undamped and nearly singular: H has a Cholesky factor in fp32 but its computed inverse has none (the second
    ``cholesky_ex``'s info), so that expert alone takes the identity, as the loop's exception does."""
    near = _factor_but_no_inverse_factor(16)
    w, h, gs, bs = _experts(3, 8, 16, seed=3)
    h[1] = near
    inv = gptq_hessian_inverse_batched(h, w, 0.0)
    assert torch.equal(inv[1], torch.eye(16)) and not torch.equal(inv[0], torch.eye(16))
    for e in range(3):
        _assert_bitwise(inv[e], gptq_hessian_inverse(h[e], w[e], 0.0))
    want = torch.stack([nvfp4_gptq(w[e], h[e], gs[e], bs[e], 0.0, 16) for e in range(3)])
    _assert_bitwise(nvfp4_gptq_batched(w, h, gs, bs, 0.0, 16), want)


def test_the_callers_weight_is_never_written_whatever_its_layout():
    """A weight that is a transposed view of ``[E, in, out]`` storage (the layout the solve works in) stays as it
    was; bf16 weights give their fp32 values' result."""
    w, h, gs, bs = _experts(3, 16, 48, seed=2)
    stored = w.transpose(1, 2).contiguous()
    view = stored.transpose(1, 2)
    before = stored.clone()
    got = nvfp4_gptq_batched(view, h, gs, bs, 0.01, 16)
    assert torch.equal(stored, before)
    _assert_bitwise(got, _loop(w, h, gs, bs, 16))
    _assert_bitwise(nvfp4_gptq_batched(w.bfloat16(), h, gs, bs, 0.01, 16), got)  # w holds bf16 values
    w64 = w.double()
    w64[1, :, 9] = 1e-50  # zero in fp32: a dead column for the loop, so for the batch too
    _assert_bitwise(nvfp4_gptq_batched(w64, h, gs, bs, 0.01, 16), _loop(w64, h, gs, bs, 16))


def test_batched_input_checks():
    w, h, gs, bs = _experts(2, 8, 32, seed=1)
    with pytest.raises(ValueError, match="weight must be"):
        nvfp4_gptq_batched(w[0], h, gs, bs)
    with pytest.raises(ValueError, match="block_scale must be"):
        nvfp4_gptq_batched(w, h, gs, bs[:1])
    with pytest.raises(ValueError, match="hessian must be"):
        nvfp4_gptq_batched(w, h[:, :16, :16], gs, bs)
    with pytest.raises(ValueError, match="global_scale must"):
        nvfp4_gptq_batched(w, h, gs[:1], bs)
    with pytest.raises(ValueError, match="block_size must"):
        nvfp4_gptq_batched(w, h, gs, bs, block_size=24)


def test_batch_bytes_counts_the_working_tensors():
    assert gptq_batch_bytes(4096, 7168, 128) == 4 * (3 * 7168 * 7168 + 2 * 4096 * 128)  # factorizing dominates
    assert gptq_batch_bytes(7168, 2048, 128) == 4 * (2048 * 2048 + 3 * 7168 * 2048 + 2 * 7168 * 128)
