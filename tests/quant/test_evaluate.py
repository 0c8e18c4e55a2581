"""KL(original || quantized) from one model object: quantizers off vs on, against a number the format predicts."""

from __future__ import annotations

import math

import pytest
import torch

from modelopt_k3 import load_pretrained, quantize
from modelopt_k3.cli import hf_ptq
from modelopt_k3.numerics.constants import FP4_MAX, FP8_E4M3_MAX, NVFP4_BLOCK
from modelopt_k3.quant.evaluate import kl_to_unquantized
from modelopt_k3.quant.modules import iter_quantizers, set_mode
from modelopt_k3.recipe import recipe_from_dict

pytestmark = pytest.mark.slow  # model loads and two forwards per batch


def _batches(seed: int) -> list[torch.Tensor]:
    return [torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed))]


def _lm_head_only(weights: str):
    return recipe_from_dict({"quant_cfg": [{"pattern": "*lm_head", "weights": weights, "inputs": None}]})


def nvfp4_rounding_variance(weight: torch.Tensor) -> torch.Tensor:
    """Per-element variance of NVFP4 weight rounding error, from the format alone (docs/FORMATS.md).

    Scales: global s_g = amax(W) / (FP4_MAX * FP8_E4M3_MAX) in fp32; block scale s_b = s_g * E4M3(amax_b /
    (FP4_MAX * s_g)), rounded to nearest by the float8_e4m3fn cast. An element x is coded as the E2M1
    value nearest x / s_b; E2M1's magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} are spaced 0.5 below 2, 1 in
    [2, 4) and 2 in [4, 6], so the error is at most half that gap times s_b. Modelled as uniform over
    the gap (the classic rounding-noise model), its variance is (gap * s_b)^2 / 12.
    """
    w = weight.detach().double()
    blocks = w.reshape(w.shape[0], -1, NVFP4_BLOCK)
    global_scale = w.abs().max() / (FP4_MAX * FP8_E4M3_MAX)
    block_amax = blocks.abs().amax(-1, keepdim=True)
    block_scale = (block_amax / (FP4_MAX * global_scale)).float().to(torch.float8_e4m3fn).double() * global_scale
    v = blocks.abs() / block_scale
    gap = torch.where(v < 2, 0.5, torch.where(v < 4, 1.0, 2.0)) * block_scale
    return (gap**2 / 12).reshape(w.shape)


def predicted_kl(probs: torch.Tensor, hidden: torch.Tensor, error_variance: torch.Tensor) -> float:
    """Second-order KL of a logit perturbation d with independent zero-mean entries of variance sigma^2.

    KL(p || softmax(z + d)) = log E_p[e^d] - E_p[d] ~= Var_p(d) / 2 for small d, and over the rounding
    noise E[Var_p(d)] = sum_i p_i sigma_i^2 - sum_i p_i^2 sigma_i^2. With d = h @ (W_q - W)^T and
    independent element errors, sigma_i^2 = sum_j h_j^2 Var(e_ij). Averaged over tokens.
    """
    sigma2 = hidden.double().pow(2) @ error_variance.T
    p = probs.double()
    return float((0.5 * ((p * sigma2).sum(-1) - (p * p * sigma2).sum(-1))).mean())


def _unquantized_probs_and_lm_head_input(model, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    head = model.get_output_embeddings()
    seen: list[torch.Tensor] = []
    hook = head.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    modes = {n: q.mode for n, q in iter_quantizers(model)}
    set_mode(model, "off")
    try:
        with torch.no_grad():
            logits = model(input_ids=batch, use_cache=False).logits.float()
    finally:
        hook.remove()
        for n, q in iter_quantizers(model):
            q.mode = modes[n]
    return torch.softmax(logits.reshape(-1, logits.shape[-1]), -1), seen[0].reshape(-1, seen[0].shape[-1])


def test_kl_of_nvfp4_lm_head_matches_the_formats_rounding_noise(tiny_ckpt):
    """Only lm_head quantized (weight-only NVFP4): the logit error is h @ (W_q - W)^T exactly, so the KL
    is predicted from the E2M1 spacing and the scale rules. The model is an approximation (uniform rounding,
    second order), measured at 0.75-0.77 of the prediction on three seeds; the band [0.5, 1.5] fails if the
    error were doubled (4x the KL), if evaluation ignored quantization (0), or for the finer FP8 (~1/12)."""
    batches = _batches(1)
    model = load_pretrained(tiny_ckpt, trust_remote_code=True, dtype=torch.float32, progress=False)
    assert kl_to_unquantized(model, batches, torch.device("cpu")) == 0.0  # unquantized: no quantizer, no KL
    quantize(model, _lm_head_only("nvfp4"), None, verbose=False)
    probs, hidden = _unquantized_probs_and_lm_head_input(model, batches[0])
    expected = predicted_kl(probs, hidden, nvfp4_rounding_variance(model.get_output_embeddings().weight))
    kl = kl_to_unquantized(model, batches, torch.device("cpu"))
    assert 0.5 * expected <= kl <= 1.5 * expected, (kl, expected)

    fp8 = load_pretrained(tiny_ckpt, trust_remote_code=True, dtype=torch.float32, progress=False)
    quantize(fp8, _lm_head_only("fp8_pb"), None, verbose=False)
    kl_fp8 = kl_to_unquantized(fp8, batches, torch.device("cpu"))
    # E4M3 has 3 mantissa bits to E2M1's 1: a 4x finer step, ~16x less rounding noise (per-128 blocks
    # give some of it back): FP8 must cost well under a quarter of NVFP4, and not nothing.
    assert 0 < kl_fp8 < kl / 4, (kl_fp8, kl)


def test_kl_positive_for_w4a4_experts_and_modes_restored(tiny_ckpt):
    """The experts' weights cast losslessly from MXFP4 (see the last test), so this KL is the activation
    quantization's alone: it must show, and evaluating must leave every quantizer's mode as it was."""
    batches = _batches(1)
    model = load_pretrained(tiny_ckpt, trust_remote_code=True, dtype=torch.float32, progress=False)
    quantize(model, "nvfp4_experts_only", lambda m: m(input_ids=batches[0], use_cache=False), verbose=False)
    modes = {n: q.mode for n, q in iter_quantizers(model)}
    kl = kl_to_unquantized(model, batches, torch.device("cpu"))
    assert {n: q.mode for n, q in iter_quantizers(model)} == modes, "modes not restored"
    assert kl > 0 and math.isfinite(kl)


def test_cli_reports_kl(tiny_ckpt, tmp_path, capsys):
    hf_ptq.main(["--pyt_ckpt_path", str(tiny_ckpt), "--trust_remote_code", "--qformat", "w4a16_nvfp4",
                 "--calib_size", "4", "--calib_seq", "32", "--eval_kl", "2", "--export_path", str(tmp_path / "o"),
                 "--no_progress"])
    line = next(x for x in capsys.readouterr().out.splitlines() if "KL(original || quantized)" in x)
    value = float(line.split(":")[-1].split()[0])
    assert value > 0 and math.isfinite(value)  # the number itself is checked against the format above


def test_weight_only_nvfp4_of_mxfp4_experts_costs_nothing(tiny_ckpt):
    """The experts are cast losslessly from their MXFP4 source: the fake-quantized model is the model."""
    recipe = recipe_from_dict(
        {"quant_cfg": [{"pattern": "*.block_sparse_moe.experts*", "weights": "nvfp4", "inputs": None}]}
    )
    model = load_pretrained(tiny_ckpt, trust_remote_code=True, dtype=torch.float32, progress=False)
    quantize(model, recipe, None, verbose=False)
    assert kl_to_unquantized(model, _batches(2), torch.device("cpu")) == 0.0

