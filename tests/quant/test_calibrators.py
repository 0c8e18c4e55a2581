"""Calibrators: the registry, the recipe spellings, and the NVFP4 block-scale searches against
independent references written here (plain Python/float64 E2M1 rounding, brute force per block)."""

from __future__ import annotations

import pytest
import torch

from modelopt_k3.numerics import nvfp4_fake_quant, nvfp4_global_scale
from modelopt_k3.numerics.nvfp4_search import (
    nvfp4_global_scale_46,
    nvfp4_multiplier_block_scales,
    nvfp4_sweep_block_scales,
)
from modelopt_k3.quant.calibrators import CALIBRATORS, calibrator_for
from modelopt_k3.recipe.algorithm import METHODS, AlgorithmError, parse_algorithm

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


_GRID = torch.tensor(GRID, dtype=torch.float64)


def _block_errors(block: list[float], scales: list[float], gs: float, hessian=None) -> torch.Tensor:
    """float64 error of one block under each candidate scale (codes from fp32 x / fp32 eff, as exported)."""
    eff = torch.tensor(scales, dtype=torch.float32)[:, None] * torch.tensor(gs, dtype=torch.float32)
    x = torch.tensor(block, dtype=torch.float32)[None, :]
    q = (x / eff).double()
    dist = (q.abs()[..., None] - _GRID).abs()
    odd = torch.arange(8) % 2
    # nearest grid point; on an exact tie the even code (the smaller distance key wins, then parity)
    pick = torch.where(dist == dist.min(-1, keepdim=True).values, odd, 2).argmin(-1)
    dq = torch.where(q < 0, -_GRID[pick], _GRID[pick]) * eff.double()
    dw = x.double() - dq
    if hessian is None:
        return (dw * dw).sum(-1)
    return torch.einsum("cb,bd,cd->c", dw, hessian.double(), dw)


def _block_error(block: list[float], scale: float, gs: float, hessian=None) -> float:
    return float(_block_errors(block, [scale], gs, hessian)[0])


def _weights(rows=6, cols=48, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-2, 1, cols).roll(7)  # blocks of varied range
    w[0, :16] = 0.0  # an all-zero block
    return w


def _choices_are_optimal(w, gs, chosen, candidates_of, hessian=None):
    """Every block's chosen scale errs no more than the best candidate (float64 reference, 1e-9 rel.)."""
    blocks = w.reshape(w.shape[0], -1, 16)
    for r in range(blocks.shape[0]):
        for b in range(blocks.shape[1]):
            block = blocks[r, b].tolist()
            h = None if hessian is None else hessian[b]
            best = float(_block_errors(block, candidates_of(r, b), float(gs), h).min())
            got = _block_error(block, float(chosen[r, b].float()), float(gs), h)
            assert got <= best * (1 + 1e-9) + 1e-30, (r, b, got, best)


def test_fp8_sweep_picks_the_brute_force_optimum_of_every_block():
    w = _weights()
    gs = nvfp4_global_scale(w.abs().amax())
    chosen = nvfp4_sweep_block_scales(w, gs)
    every_e4m3 = [float(torch.tensor([i], dtype=torch.uint8).view(torch.float8_e4m3fn).float()) for i in range(1, 127)]
    _choices_are_optimal(w, gs, chosen, lambda r, b: every_e4m3)
    assert float(chosen[0, 0].float()) == 1.0  # the all-zero block keeps max's scale
    # It differs from max somewhere (else the test would not tell them apart) and never errs more.
    dq_max, dq = nvfp4_fake_quant(w, gs), nvfp4_fake_quant(w, gs, block_scale=chosen)
    assert ((dq - w) ** 2).sum() < ((dq_max - w) ** 2).sum()


def test_four_over_six_chooses_six_or_four_per_block():
    w = _weights(seed=1)
    amax = w.abs().amax()
    gs = nvfp4_global_scale_46(amax)
    assert float(gs) == float(amax) / (6 * 256)
    chosen = nvfp4_multiplier_block_scales(w, gs, (1.0, 1.5))
    blocks = w.reshape(w.shape[0], -1, 16)
    n4 = 0
    for r in range(blocks.shape[0]):
        for b in range(blocks.shape[1]):
            block = blocks[r, b].tolist()
            bamax = max(abs(x) for x in block)
            if bamax == 0:
                assert float(chosen[r, b].float()) == 1.0
                continue
            s6, s4 = (float(torch.tensor(bamax * m / (6 * float(gs))).clamp(2**-9, 448).to(torch.float8_e4m3fn).float())
                      for m in (1.0, 1.5))
            e6, e4 = _block_error(block, s6, float(gs)), _block_error(block, s4, float(gs))
            want = s4 if e4 < e6 * (1 - 1e-9) else s6
            if abs(e4 - e6) > 1e-9 * e6:  # a clear winner: exactly it (near-ties may go either way)
                assert float(chosen[r, b].float()) == want, (r, b, e6, e4)
            n4 += float(chosen[r, b].float()) == s4 != s6
    assert 0 < n4 < blocks.shape[0] * blocks.shape[1]  # both choices occur


def test_hessian_weighted_sweep_is_optimal_for_its_weighted_error():
    w = _weights(rows=3, cols=32, seed=2)
    gs = nvfp4_global_scale(w.abs().amax())
    g = torch.Generator().manual_seed(3)
    a = torch.randn(2, 16, 64, generator=g)
    a[:, 3] *= 20  # an outlier channel: the weighting must matter
    h = (a @ a.transpose(1, 2)) / 64
    chosen = nvfp4_sweep_block_scales(w, gs, hessian=h)
    every_e4m3 = [float(torch.tensor([i], dtype=torch.uint8).view(torch.float8_e4m3fn).float()) for i in range(1, 127)]
    _choices_are_optimal(w, gs, chosen, lambda r, b: every_e4m3, hessian=h)
    assert not torch.equal(chosen.view(torch.uint8), nvfp4_sweep_block_scales(w, gs).view(torch.uint8))


def test_registry_covers_every_recipe_method_and_spellings_parse():
    assert set(CALIBRATORS) == set(METHODS)
    assert parse_algorithm("max") == "max"
    mse = parse_algorithm({"method": "mse", "fp8_scale_sweep": True})
    assert mse.get("fp8_scale_sweep") is True and mse.get("step_size") == 0.1 and mse != "mse"
    assert type(calibrator_for(mse)).__name__ == "MseCalibrator"
    lh = parse_algorithm({"method": "local_hessian", "fp8_scale_sweep": True})
    assert parse_algorithm(lh.to_recipe()) == lh
    with pytest.raises(AlgorithmError, match="algorithm mse has no option 'perc_damp'"):
        parse_algorithm({"method": "mse", "perc_damp": 0.01})
    gptq = parse_algorithm({"method": "gptq", "perc_damp": 0.01, "block_size": 128, "layerwise": {"enable": False}})
    assert parse_algorithm(gptq.to_recipe()) == gptq and not gptq.layerwise.enable and gptq.qdq_inputs()
    # ModelOpt's LayerwiseConfig, for any method; GPTQ alone feeds each layer quantized inputs by default.
    on = parse_algorithm({"method": "max", "layerwise": {"enable": True, "checkpoint_dir": "/ck"}})
    assert on.layerwise.enable and on.layerwise.checkpoint_dir == "/ck" and not on.qdq_inputs() and on != "max"
    assert parse_algorithm(on.to_recipe()) == on
    assert parse_algorithm({"method": "max", "layerwise": {"enable": True,
                                                            "get_qdq_activations_from_prev_layer": True}}).qdq_inputs()
    with pytest.raises(AlgorithmError, match="layerwise.checkpoint_dir needs layerwise.enable: true"):
        parse_algorithm({"method": "max", "layerwise": {"checkpoint_dir": "/ck"}})
    with pytest.raises(AlgorithmError, match="layerwise has no option 'save_every'"):
        parse_algorithm({"method": "gptq", "layerwise": {"enable": True, "save_every": 2}})
    with pytest.raises(AlgorithmError, match="'awq' is not supported"):
        parse_algorithm({"method": "awq"})
    with pytest.raises(AlgorithmError, match="fp8_scale_sweep must be bool"):
        parse_algorithm({"method": "mse", "fp8_scale_sweep": "yes"})
    with pytest.raises(ValueError, match="cannot combine with fp8_scale_sweep"):
        calibrator_for({"method": "mse", "fp8_scale_sweep": True, "four_over_six": True})


def test_gptq_lowers_the_output_error_of_max_under_the_same_scales():
    from modelopt_k3.numerics import nvfp4_block_scales
    from modelopt_k3.numerics.gptq import nvfp4_gptq

    g = torch.Generator().manual_seed(4)
    w = torch.randn(24, 64, generator=g)
    x = torch.randn(256, 64, generator=g)
    x[:, 9] *= 15  # an outlier input channel, as real activations have
    gs = nvfp4_global_scale(w.abs().amax())
    bs = nvfp4_block_scales(w, gs)
    w_hat = nvfp4_gptq(w, 2 * x.T @ x / x.shape[0], gs, bs, perc_damp=0.01, block_size=32)
    assert torch.equal(nvfp4_fake_quant(w_hat, gs, block_scale=bs), w_hat)  # on the grid of max's scales
    err_gptq = ((x @ (w - w_hat).T) ** 2).sum()
    err_max = ((x @ (w - nvfp4_fake_quant(w, gs)).T) ** 2).sum()
    assert err_gptq < 0.9 * err_max, (err_gptq, err_max)
