"""KL(original || quantized) from one model object: quantizers off vs on."""

from __future__ import annotations

import math

import torch

from modelopt_k3 import load_pretrained, quantize
from modelopt_k3.cli import hf_ptq
from modelopt_k3.quant.evaluate import kl_to_unquantized
from modelopt_k3.quant.modules import iter_quantizers


def test_kl_positive_for_w4a4_experts_and_modes_restored(tiny_ckpt):
    batches = [torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))]
    model = load_pretrained(tiny_ckpt, trust_remote_code=True, dtype=torch.float32, progress=False)
    quantize(model, "nvfp4_experts_only", lambda m: m(input_ids=batches[0], use_cache=False), verbose=False)
    modes = {n: q.mode for n, q in iter_quantizers(model)}
    kl = kl_to_unquantized(model, batches, torch.device("cpu"))
    assert {n: q.mode for n, q in iter_quantizers(model)} == modes, "modes not restored"
    assert 0 < kl < 1.0 and math.isfinite(kl)  # W4A4 experts: activations are quantized


def test_cli_reports_kl(tiny_ckpt, tmp_path, capsys):
    hf_ptq.main(["--pyt_ckpt_path", str(tiny_ckpt), "--trust_remote_code", "--qformat", "w4a16_nvfp4",
                 "--calib_size", "4", "--calib_seq", "32", "--eval_kl", "2", "--export_path", str(tmp_path / "o"),
                 "--no_progress"])
    line = next(x for x in capsys.readouterr().out.splitlines() if "KL(original || quantized)" in x)
    value = float(line.split(":")[-1].split()[0])
    assert 0 < value < 1.0


def test_weight_only_nvfp4_of_mxfp4_experts_costs_nothing(tiny_ckpt):
    """The experts are cast losslessly from their MXFP4 source: the fake-quantized model is the model."""
    from modelopt_k3.recipe import recipe_from_dict

    recipe = recipe_from_dict(
        {"quant_cfg": [{"pattern": "*.block_sparse_moe.experts*", "weights": "nvfp4", "inputs": None}]}
    )
    model = load_pretrained(tiny_ckpt, trust_remote_code=True, dtype=torch.float32, progress=False)
    quantize(model, recipe, None, verbose=False)
    batches = [torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))]
    assert kl_to_unquantized(model, batches, torch.device("cpu")) == 0.0
