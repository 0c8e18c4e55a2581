"""Calibrators: the registry, the recipe spellings, and the NVFP4 block-scale searches against
independent references written here (plain Python/float64 E2M1 rounding, brute force per block)."""

from __future__ import annotations

import pytest
import torch

from modelopt_k3.numerics import nvfp4_fake_quant, nvfp4_global_scale
from modelopt_k3.numerics.nvfp4_search import (
    FOUR_OVER_SIX_MULTIPLIERS,
    nvfp4_global_scale_46,
    nvfp4_multiplier_block_scales,
    nvfp4_sweep_block_scales,
)
from modelopt_k3.quant.calibrators import CALIBRATORS, CONFIGS, algorithm_config, calibrator_for, qdq_inputs
from modelopt_k3.recipe.algorithm import AlgorithmError, parse_algorithm

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
    # One handler per config type, one config per method, and each handler's config is its own.
    assert set(CALIBRATORS) == set(CONFIGS.values())
    assert all(handler.config_type is config for config, handler in CALIBRATORS.items())
    assert parse_algorithm("max") == "max"
    mse = parse_algorithm({"method": "mse", "fp8_scale_sweep": True})
    config = algorithm_config(mse)
    assert config.fp8_scale_sweep is True and config.step_size == 0.1 and mse != "mse"
    assert type(calibrator_for(mse)).__name__ == "MseCalibrator"
    lh = parse_algorithm({"method": "local_hessian", "fp8_scale_sweep": True})
    assert parse_algorithm(lh.to_recipe()) == lh
    with pytest.raises(AlgorithmError, match="algorithm mse has no option 'perc_damp'"):
        algorithm_config({"method": "mse", "perc_damp": 0.01})
    gptq = parse_algorithm({"method": "gptq", "perc_damp": 0.01, "block_size": 128, "layerwise": {"enable": False}})
    assert parse_algorithm(gptq.to_recipe()) == gptq and not gptq.layerwise.enable and qdq_inputs(gptq)
    # ModelOpt's LayerwiseConfig, for any method; GPTQ alone feeds each layer quantized inputs by default.
    on = parse_algorithm({"method": "max", "layerwise": {"enable": True, "checkpoint_dir": "/ck"}})
    assert on.layerwise.enable and on.layerwise.checkpoint_dir == "/ck" and not qdq_inputs(on) and on != "max"
    assert parse_algorithm(on.to_recipe()) == on
    assert qdq_inputs(parse_algorithm({"method": "max", "layerwise": {"enable": True,
                                                                       "get_qdq_activations_from_prev_layer": True}}))
    with pytest.raises(AlgorithmError, match="layerwise.checkpoint_dir needs layerwise.enable: true"):
        parse_algorithm({"method": "max", "layerwise": {"checkpoint_dir": "/ck"}})
    with pytest.raises(AlgorithmError, match="layerwise has no option 'save_every'"):
        parse_algorithm({"method": "gptq", "layerwise": {"enable": True, "save_every": 2}})
    with pytest.raises(AlgorithmError, match="'smoothquant' is not supported"):
        calibrator_for({"method": "smoothquant"})
    with pytest.raises(AlgorithmError, match="fp8_scale_sweep must be bool"):
        algorithm_config({"method": "mse", "fp8_scale_sweep": "yes"})
    with pytest.raises(AlgorithmError, match="must be a name with a scalar value"):
        parse_algorithm({"method": "mse", "step_size": [0.1]})
    with pytest.raises(ValueError, match="cannot combine with fp8_scale_sweep"):
        calibrator_for({"method": "mse", "fp8_scale_sweep": True, "four_over_six": True})


def test_every_algorithm_preset_recipe_is_its_base_with_the_registrys_algorithm():
    """``<base>_<preset>.yaml`` is data: its base's modules and formats with the algorithm the registry's preset
    names; the generic bases have one for every preset (``recipe_name`` falls back to them)."""
    from modelopt_k3.quant.calibrators import qformat_presets
    from modelopt_k3.recipe import RecipeError, load_recipe

    presets = qformat_presets()
    assert {"nvfp4_mse", "nvfp4_four_over_six", "nvfp4_local_hessian", "nvfp4_gptq", "nvfp4_act_headroom"} <= set(presets)
    for base in ("presets/nvfp4", "presets/nvfp4_default", "models/openai/gpt-oss/nvfp4",
                 "models/deepseek-ai/DeepSeek-V3/nvfp4"):
        plain = load_recipe(base).to_dict()
        for name, algorithm in presets.values():
            try:
                variant = load_recipe(f"{base}_{name}")
            except RecipeError:
                assert not base.startswith("presets/"), f"{base}_{name} is missing"
                continue
            assert algorithm_config(variant.algorithm) == algorithm_config(algorithm), variant.name
            assert {**variant.to_dict(), "algorithm": None} == {**plain, "algorithm": None}, variant.name


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


def test_gptq_asymmetric_target_aims_at_the_unquantized_output():
    """When the inputs ``y`` a Linear gets differ from the unquantized model's ``x`` (earlier Linears quantized),
    GPTQ on ``asymmetric_target``'s weight errs less in ``||W x - Ŵ y||`` than GPTQ of the weight itself, and the
    target is the weight where ``x == y``."""
    from modelopt_k3.numerics import nvfp4_block_scales
    from modelopt_k3.numerics.gptq import asymmetric_target, nvfp4_gptq

    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 64, generator=g)
    x = torch.randn(512, 64, generator=g)
    x[:, 3] *= 12
    # The inputs' error as an earlier quantized Linear leaves it: mostly a fixed distortion, some noise.
    y = x @ (torch.eye(64) + 0.1 * torch.randn(64, 64, generator=g)) + 0.02 * torch.randn(512, 64, generator=g)
    gs = nvfp4_global_scale(w.abs().amax())
    bs = nvfp4_block_scales(w, gs)
    h = 2 * y.T @ y / y.shape[0]
    target = asymmetric_target(w, y.T.double() @ y.double(), x.T.double() @ y.double(), 0.01)
    plain, aimed = (nvfp4_gptq(t, h, gs, bs, perc_damp=0.01, block_size=32) for t in (w, target))
    err = {name: float(((x @ w.T - y @ v.T) ** 2).sum()) for name, v in
           (("max", nvfp4_fake_quant(w, gs)), ("plain", plain), ("aimed", aimed))}
    assert err["aimed"] < 0.5 * min(err["plain"], err["max"]), err
    assert torch.equal(asymmetric_target(w, x.T.double() @ x.double(), x.T.double() @ x.double()), w)
    with pytest.raises(ValueError, match="sums must be"):
        asymmetric_target(w, h[:8, :8], h)


def test_gptq_asymmetric_needs_true_sequential():
    from modelopt_k3.quant.calibrators import calibrator_for

    with pytest.raises(ValueError, match="asymmetric needs true_sequential"):
        calibrator_for({"method": "gptq", "asymmetric": True})
    assert calibrator_for({"method": "gptq", "true_sequential": True, "asymmetric": True}).config.asymmetric


# --------------------------------------------------------------------------- issue 33: what tells a wrong answer


def test_a_tie_keeps_the_first_smallest_scale_of_the_sweep():
    """Blocks that several E4M3 scales quantize exactly (zero error for each): the sweep keeps the first,
    the smallest, as ModelOpt's strict ``<`` does; e.g. 3.0 everywhere is 6 x 0.5 (not 0.5 x 6). That is max's
    scale too (it maps the block's amax to 6, so any smaller scale clips), which every tie keeps (issue 42)."""
    gs = torch.tensor(1.0)
    w = torch.tensor([[3.0] * 16, [1.5, -6.0] * 8, [0.25, 0.5, 0.75, 1.5] * 4])
    chosen = nvfp4_sweep_block_scales(w, gs)
    every_e4m3 = [float(torch.tensor([i], dtype=torch.uint8).view(torch.float8_e4m3fn).float()) for i in range(1, 127)]
    for r in range(w.shape[0]):
        errors = _block_errors(w[r].tolist(), every_e4m3, 1.0)
        zero = [s for s, e in zip(every_e4m3, errors.tolist()) if e == 0.0]
        assert len(zero) > 1 and float(chosen[r, 0].float()) == zero[0], (r, zero, chosen[r])
    assert float(chosen[0, 0].float()) == 0.5


def _reference_gptq(w, h, gs, bs, perc_damp):
    """Unblocked GPTQ in float64, written from the algorithm: damp H by perc_damp x its mean diagonal, take the
    upper Cholesky factor U of H^-1, then left to right round column j and subtract (w_j - q_j) / U_jj x U_j,>j
    from the columns after it."""
    w, h = w.double().clone(), h.double().clone()
    n = w.shape[1]
    h += torch.eye(n, dtype=torch.float64) * (perc_damp * h.diag().mean())
    u = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)
    for j in range(n):
        q = nvfp4_fake_quant(w.float(), gs, block_scale=bs).double()[:, j]
        err = (w[:, j] - q) / u[j, j]
        w[:, j] = q
        w[:, j + 1:] -= err[:, None] * u[j, j + 1:][None, :]
    return w.float()


@pytest.mark.parametrize("block_size", [16, 64])
def test_gptq_equals_the_unblocked_reference_for_any_column_block(block_size):
    from modelopt_k3.numerics import nvfp4_block_scales
    from modelopt_k3.numerics.gptq import nvfp4_gptq

    g = torch.Generator().manual_seed(4)
    w = torch.randn(24, 64, generator=g)
    x = torch.randn(256, 64, generator=g)
    x[:, 9] *= 15
    h = 2 * x.T @ x / x.shape[0]
    gs = nvfp4_global_scale(w.abs().amax())
    bs = nvfp4_block_scales(w, gs)
    got = nvfp4_gptq(w, h, gs, bs, perc_damp=0.01, block_size=block_size)
    want = _reference_gptq(w, h, gs, bs, 0.01)
    assert torch.equal(got, want), (got != want).float().mean()
    assert not torch.equal(got, nvfp4_fake_quant(w, gs, block_scale=bs))  # GPTQ moved something


def test_gptq_damping_is_relative_so_scaling_the_hessian_changes_nothing():
    """``perc_damp`` is a share of the mean diagonal: H and H / 2**20 give the same weights, bit for bit (a power
    of two scales every step exactly); an absolute damping would swamp the small one."""
    from modelopt_k3.numerics import nvfp4_block_scales
    from modelopt_k3.numerics.gptq import nvfp4_gptq

    g = torch.Generator().manual_seed(5)
    w = torch.randn(16, 32, generator=g)
    x = torch.randn(128, 32, generator=g)
    h = 2 * x.T @ x / x.shape[0]
    gs = nvfp4_global_scale(w.abs().amax())
    bs = nvfp4_block_scales(w, gs)
    a = nvfp4_gptq(w, h, gs, bs, perc_damp=0.01, block_size=16)
    assert torch.equal(a, nvfp4_gptq(w, h * 2.0**-20, gs, bs, perc_damp=0.01, block_size=16))
    assert not torch.equal(a, nvfp4_fake_quant(w, gs, block_scale=bs))


def test_a_bool_is_no_integer_or_float_option():
    for value in ({"method": "gptq", "block_size": True}, {"method": "gptq", "perc_damp": False},
                  {"method": "mse", "step_size": True}):
        with pytest.raises(AlgorithmError, match="must be (int|float), got (True|False)"):
            algorithm_config(value)
    damp = algorithm_config({"method": "gptq", "perc_damp": 1}).perc_damp
    assert damp == 1.0 and type(damp) is float  # an int is a float


def test_the_sweep_candidates_are_every_positive_finite_e4m3_value():
    from modelopt_k3.numerics.nvfp4_search import e4m3_scale_candidates

    c = e4m3_scale_candidates().float()
    assert c.numel() == 126 and float(c[0]) == 2.0**-9 and float(c[-1]) == 448.0
    assert bool((c[1:] > c[:-1]).all())
    assert set(c.tolist()) == {v for v in torch.arange(256, dtype=torch.int32).to(torch.uint8)
                               .view(torch.float8_e4m3fn).float().tolist() if v > 0 and v == v and v != float("inf")}


def test_four_over_six_global_scale_is_amax_over_1536_and_one_only_for_zero():
    assert float(nvfp4_global_scale_46(1.0)) == float(torch.tensor(1.0) / 1536)  # fp32, as exported
    assert float(nvfp4_global_scale_46(3072.0)) == 2.0
    assert float(nvfp4_global_scale_46(0.0)) == 1.0


def test_the_hessian_grid_of_a_weight_only_linear_comes_from_its_weight():
    """A weight-only Linear (w4a16) has no input quantizer: the split grid takes the weight's amax."""
    from types import SimpleNamespace

    from modelopt_k3.quant.calibrators.moments import input_amax

    linear = torch.nn.Linear(16, 4)
    linear.input_quantizer = None
    linear.weight_quantizer = SimpleNamespace(amax=torch.tensor([0.5, 3.0]))
    assert input_amax(linear) == 3.0
    linear.input_quantizer = SimpleNamespace(calibrated=False, amax=None)
    assert input_amax(linear) == 3.0
    linear.input_quantizer = SimpleNamespace(calibrated=True, amax=torch.tensor(7.0))
    assert input_amax(linear) == 7.0


def _one_linear(seed: int, in_f: int = 32, out_f: int = 8, inputs: bool = True, scale: float = 1.0):
    from modelopt_k3.quant.modules import attach_linear
    from modelopt_k3.quant.schemes import NVFP4_TENSOR

    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(in_f, out_f, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(out_f, in_f, generator=g) * torch.logspace(-1, 1, in_f) * scale)
    attach_linear(model[0], NVFP4_TENSOR, NVFP4_TENSOR if inputs else None, None)
    return model, g


def test_the_four_over_six_calibrator_sets_the_256_global_scale_and_searches_under_it():
    model, _ = _one_linear(6)
    cal = calibrator_for({"method": "mse", "four_over_six": True, "start_multiplier": 1.0, "stop_multiplier": 1.5,
                          "step_size": 0.5})
    assert cal.multipliers == (1.0, 1.5)
    cal.finalize_weights(model)
    q, w = model[0].weight_quantizer, model[0].weight.detach()
    gs = nvfp4_global_scale_46(w.abs().amax())
    assert torch.equal(q.scale(), gs)
    assert torch.equal(q.block_scale.view(torch.uint8), nvfp4_multiplier_block_scales(w, gs, (1.0, 1.5)).view(torch.uint8))
    assert cal.labels["0"].startswith("mse(")


def test_local_hessian_weights_by_the_linears_input_before_its_own_quantizer():
    """One Linear, NVFP4 inputs with an outlier channel per block: the block Hessians are ``E[x xᵀ]`` of the input as it
    arrives (here the data itself), not of its fake-quantized copy; the scales are the sweep's under them."""
    from modelopt_k3.numerics.nvfp4_search import nvfp4_sweep_block_scales as sweep

    model, g = _one_linear(7, out_f=32)
    x = torch.randn(64, 32, generator=g)
    x[:, [5, 21]] *= 200  # one outlier per 16-block: the fake-quantized input zeroes most of the others

    def loop(m):
        with torch.no_grad():
            m(x)

    calibrator_for("local_hessian").calibrate(model, loop, {})
    q, w = model[0].weight_quantizer, model[0].weight.detach()
    xb = x.double().reshape(-1, 2, 16)
    h = torch.einsum("tnb,tnd->nbd", xb, xb) / x.shape[0]
    want = sweep(w, q.scale(), hessian=h.float())
    assert torch.equal(q.block_scale.view(torch.uint8), want.view(torch.uint8))
    xq = model[0].input_quantizer(x).double().reshape(-1, 2, 16)  # what a hook after the input quantizer sees
    hq = torch.einsum("tnb,tnd->nbd", xq, xq) / x.shape[0]
    assert not torch.equal(sweep(w, q.scale(), hessian=hq.float()).view(torch.uint8), want.view(torch.uint8))


def test_moment_sums_take_a_zero_or_non_finite_amax_and_refuse_past_the_exact_token_count():
    """The split grid of an input whose amax is 0 (never reached) or not finite falls back to 2**-14 and still
    sums exactly; an expert's sums are refused past 2**21 tokens (where float64 stops holding them exactly)."""
    from modelopt_k3.quant.calibrators.moments import Accumulator, ExpertSums

    x = torch.tensor([[1.0, -2.0, 0.5, 0.0] * 4, [3.0, 0.25, -1.0, 2.0] * 4])
    xb = x.double().reshape(2, 1, 16)
    for amax in (0.0, float("inf"), float("nan")):
        acc = Accumulator(True, amax)
        assert (acc.g1, acc.g2) == (2.0**-14, 2.0**-28)
        acc.add(x)
        assert torch.equal(acc.combine(acc.hh, acc.hl), torch.einsum("tnb,tnd->nbd", xb, xb))
    sums = ExpertSums(None, "down_proj", True)
    for tokens in (2**21, 2**21 + 1):
        acc = Accumulator(True, 1.0)
        acc.add(x)
        acc.tokens = tokens
        sums.by_expert[0] = acc
        if tokens > 2**21:
            with pytest.raises(ValueError, match=r"exact up to 2097152"):
                sums.pop(0)
        else:
            assert sums.pop(0)[1] == tokens and sums.pop(0) is None


def test_local_hessian_weights_only_the_experts_that_have_a_hessian():
    """A chunk of local experts where only expert 0 got tokens: expert 0's blocks by its Hessian, expert 1's by
    the plain-error search (the same scales a chunk without any Hessian gets)."""
    from modelopt_k3.numerics.nvfp4_search import nvfp4_sweep_block_scales as sweep

    g = torch.Generator().manual_seed(11)
    w = torch.randn(2, 8, 32, generator=g) * torch.logspace(-1, 1, 32)
    gs = torch.full((2,), float(w.abs().amax()) / (6 * 448))
    h = torch.randn(2, 16, 16, generator=g).double()
    h = (h @ h.transpose(-1, -2) + torch.diag_embed(torch.logspace(-3, 3, 16).double().expand(2, 16))).float()
    cal = calibrator_for("local_hessian")
    module = torch.nn.Module()
    cal.expert_hessians = {(id(module), "down_proj"): {0: h}}
    got = cal.search(w, gs, module, "down_proj", range(2))
    assert torch.equal(got[0].view(torch.uint8), sweep(w[0], gs[0], hessian=h).view(torch.uint8))
    assert torch.equal(got[1].view(torch.uint8), sweep(w[1], gs[1]).view(torch.uint8))
    assert not torch.equal(got[0].view(torch.uint8), sweep(w[0], gs[0]).view(torch.uint8))  # the weighting mattered


def test_weight_searches_refuse_an_fsdp2_sharded_weight(monkeypatch):
    """A search needs the whole weight: an FSDP2-sharded one is refused in one line naming the way out."""
    from modelopt_k3.quant.calibrators import weights

    model, _ = _one_linear(8)
    monkeypatch.setattr(weights, "is_sharded", lambda t: True)
    with pytest.raises(ValueError, match="FSDP2-sharded: use --plan whole or expert_parallel with --dense replicated"):
        calibrator_for("mse").finalize_weights(model)


def test_an_algorithm_registers_once_by_config_type_and_owns_its_preset_names():
    from dataclasses import dataclass

    from modelopt_k3.quant.calibrators import AlgorithmConfig, register_calibrator
    from modelopt_k3.quant.calibrators.max import MaxCalibrator, MaxConfig

    with pytest.raises(ValueError, match="'max' is already registered"):
        register_calibrator(type("Again", (MaxCalibrator,), {"config_type": MaxConfig}))

    @dataclass(frozen=True)
    class Clash(AlgorithmConfig):
        method = "clash"
        presets = {"gptq": {}}

    with pytest.raises(ValueError, match=r"preset\(s\) \['gptq'\] already belong to another algorithm"):
        register_calibrator(type("ClashCalibrator", (MaxCalibrator,), {"config_type": Clash}))
    with pytest.raises(TypeError, match="names no config_type of its own"):
        register_calibrator(type("Inherits", (MaxCalibrator,), {}))
    assert "clash" not in CONFIGS


# --------------------------------------------------------------------------- issue 42: never lose to max


def _max_scales(w: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    from modelopt_k3.numerics.nvfp4 import nvfp4_block_scales

    return nvfp4_block_scales(w, gs).view(torch.uint8)


@pytest.mark.parametrize("search", ["sweep", "multipliers"])
def test_a_zero_hessian_keeps_max_scales(search):
    """A Linear whose calibration inputs are all zero has a zero Hessian: every candidate errs 0. The sweep kept
    the smallest (2**-9) and the Linear became ~0 (relative RMS error 1.0); every block now keeps max's."""
    w = _weights()
    gs = nvfp4_global_scale(w.abs().amax())
    zero = torch.zeros(w.shape[1] // 16, 16, 16)
    chosen = (nvfp4_sweep_block_scales(w, gs, hessian=zero) if search == "sweep"
              else nvfp4_multiplier_block_scales(w, gs, (0.5, 1.0, 1.5), hessian=zero))
    assert torch.equal(chosen.view(torch.uint8), _max_scales(w, gs))
    dq = nvfp4_fake_quant(w, gs, block_scale=chosen)
    assert torch.equal(dq, nvfp4_fake_quant(w, gs))


def test_a_non_finite_hessian_keeps_max_scales():
    w = _weights()
    gs = nvfp4_global_scale(w.abs().amax())
    h = torch.eye(16).repeat(w.shape[1] // 16, 1, 1)
    h[0, 0, 0] = float("nan")
    h[1, 0, 0] = float("inf")
    chosen = nvfp4_sweep_block_scales(w, gs, hessian=h).view(torch.uint8)
    assert torch.equal(chosen[:, :2], _max_scales(w, gs)[:, :2])
    assert not torch.equal(chosen[:, 2:], _max_scales(w, gs)[:, 2:])  # the finite blocks still search


@pytest.mark.parametrize("search", ["sweep", "four_over_six"])
def test_subnormal_weights_keep_max_result(search):
    """Weights so small that every candidate's squared error underflows fp32 tie at zero: they keep max's codes
    instead of being zeroed by the smallest scale."""
    w = _weights() * 1e-30
    if search == "sweep":
        gs = nvfp4_global_scale(w.abs().amax())
        chosen = nvfp4_sweep_block_scales(w, gs)
    else:
        gs = nvfp4_global_scale_46(w.abs().amax())
        chosen = nvfp4_multiplier_block_scales(w, gs, FOUR_OVER_SIX_MULTIPLIERS)
    assert torch.equal(chosen.view(torch.uint8), _max_scales(w, gs))
    assert nvfp4_fake_quant(w, gs, block_scale=chosen).abs().amax() > 0


def _export(model) -> tuple[torch.Tensor, ...]:
    """The Linear's exported NVFP4 tensors (codes, block scales, global scale) and its input scale."""
    from modelopt_k3.numerics import nvfp4_quantize

    lin = model[0]
    q = lin.weight_quantizer
    out = nvfp4_quantize(lin.weight.detach(), q.scale(), **q.searched_scales())
    return out.packed, out.block_scale.view(torch.uint8), out.global_scale, lin.input_quantizer.scale()


def _exports_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_local_hessian_on_all_zero_inputs_exports_what_max_exports():
    """Every calibration input 0: each block Hessian is 0 and every candidate ties at zero error; local_hessian
    used to give every block 2**-9 (the weight exported as ~0, relative RMS error 1.0). It now keeps max's."""
    x = torch.zeros(16, 32)

    def loop(m):
        with torch.no_grad():
            m(x)

    got, ref = _one_linear(12)[0], _one_linear(12)[0]
    calibrator_for("local_hessian").calibrate(got, loop, {})
    calibrator_for("max").calibrate(ref, loop, {})
    assert got[0].weight_quantizer.block_scale is not None  # the search ran (and chose max's scales)
    assert _exports_equal(_export(got), _export(ref))
    lin = got[0]
    w = lin.weight.detach()
    dq = nvfp4_fake_quant(w, lin.weight_quantizer.scale(), block_scale=lin.weight_quantizer.block_scale)
    assert float((dq - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()) < 0.2


@pytest.mark.parametrize("algorithm", ["mse", "local_hessian", "four_over_six"])
def test_weight_searches_keep_max_codes_on_a_subnormal_linear(algorithm):
    """A Linear whose weights are fp32-subnormal: every search's errors underflow to ties; the export's codes and
    block scales are max's (four-over-six's under its own 256-normalized global scale, where x1.0 is max's rule)."""
    from modelopt_k3.numerics import nvfp4_global_scale, nvfp4_quantize

    g = torch.Generator().manual_seed(13)
    x = torch.randn(16, 32, generator=g)

    def loop(m):
        with torch.no_grad():
            m(x)

    got, ref = _one_linear(13, scale=1e-39)[0], _one_linear(13, scale=1e-39)[0]
    spelled = {"four_over_six": {"method": "mse", "four_over_six": True, "start_multiplier": 1.0,
                                 "stop_multiplier": 1.5, "step_size": 0.5},
               "mse": {"method": "mse", "fp8_scale_sweep": True}}.get(algorithm, algorithm)
    calibrator_for(spelled).calibrate(got, loop, {})
    calibrator_for("max").calibrate(ref, loop, {})
    w, q = got[0].weight.detach(), got[0].weight_quantizer
    if algorithm == "four_over_six":
        gs = nvfp4_global_scale_46(w.abs().amax())
    else:
        gs = nvfp4_global_scale(w.abs().amax())
        assert _exports_equal(_export(got), _export(ref))
    out = nvfp4_quantize(w, gs, **q.searched_scales())
    want = nvfp4_quantize(w, gs)  # max's rule under that global scale
    assert torch.equal(out.packed, want.packed) and torch.equal(out.block_scale.view(torch.uint8),
                                                                want.block_scale.view(torch.uint8))
    assert bool((want.packed != 0).any())
