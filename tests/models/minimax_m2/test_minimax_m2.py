"""MiniMax-M2 on the generic transformers-native spec: the hub's names on transformers' own classes, the block-FP8
source decoded as it loads, logits equal to transformers' own model, and ``hf_ptq`` with the default recipe
(resident, layerwise) writing the hub's names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _exports import read_export
from _standins import dequantized_copy, stored

from modelopt_k3.testing.minimax_m2 import calibration_token_ids

PTQ = ["--qformat", "nvfp4", "--calib_size", "8", "--batch_size", "4", "--calib_seq", "32", "--no_progress",
       "--report", "none"]


def test_logits_equal_transformers_bit_for_bit_with_the_hub_names(minimax_m2_ckpt, tmp_path):
    """Our load (block-FP8 decoded as it loads, experts fused from w1/w3/w2) gives transformers' own
    MiniMaxM2ForCausalLM's bf16 logits bit for bit, on its dequantized copy; our model's names are the hub's."""
    from transformers import AutoModelForCausalLM

    import modelopt_k3

    model = modelopt_k3.load_pretrained(minimax_m2_ckpt, progress=False)
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    assert {"model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.gate_up_proj",
            "model.layers.1.block_sparse_moe.e_score_correction_bias"} <= names
    assert not any(".mlp." in n for n in names)
    assert set(model.modelopt_k3.spec.experts_modules(model)) == {f"model.layers.{i}.block_sparse_moe.experts"
                                                                   for i in range(2)}
    ids = calibration_token_ids()
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    ref = AutoModelForCausalLM.from_pretrained(dequantized_copy(minimax_m2_ckpt, tmp_path / "bf16"),
                                               dtype=torch.bfloat16, experts_implementation="eager")
    with torch.no_grad():
        theirs = ref(input_ids=ids).logits
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)


@pytest.mark.slow
def test_an_fp32_load_gives_transformers_fp32_logits(minimax_m2_ckpt, tmp_path):
    """fp32: every block-FP8 weight decoded as fp8 x scale_inv in fp32 (transformers' ``_dequantize_fp8_weight``),
    expert w1 the first half of gate_up_proj, logits within 1e-5 of transformers' fp32 model."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    import modelopt_k3

    model = modelopt_k3.load_pretrained(minimax_m2_ckpt, dtype=torch.float32, progress=False)
    src, block = stored(minimax_m2_ckpt), [128, 128]
    params = dict(model.named_parameters())
    key = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(params[key], _dequantize_fp8_weight(src[key], src[key + "_scale_inv"], block, torch.float32))
    w1 = "model.layers.1.block_sparse_moe.experts.5.w1.weight"
    want = _dequantize_fp8_weight(src[w1], src[w1 + "_scale_inv"], block, torch.float32)
    assert torch.equal(params["model.layers.1.block_sparse_moe.experts.gate_up_proj"][5, : want.shape[0]], want)
    ref = AutoModelForCausalLM.from_pretrained(dequantized_copy(minimax_m2_ckpt, tmp_path / "fp32", torch.float32),
                                               dtype=torch.float32, experts_implementation="eager")
    ids = calibration_token_ids()
    with torch.no_grad():
        ours, theirs = model(input_ids=ids).logits, ref(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def _ptq(*argv) -> int:
    from modelopt_k3.cli import hf_ptq

    return hf_ptq.run(hf_ptq.build_parser().parse_args([*PTQ, *map(str, argv)]))


def _assert_same_export(a: Path, b: Path) -> None:
    ta, tb = read_export(a), read_export(b)
    assert set(ta) == set(tb), sorted(set(ta) ^ set(tb))[:10]
    differ = [k for k in ta if ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape
              or not torch.equal(ta[k].reshape(-1).view(torch.uint8), tb[k].reshape(-1).view(torch.uint8))]
    assert differ == [], differ[:10]
    for name in ("config.json", "hf_quant_config.json"):
        assert json.loads((a / name).read_text()) == json.loads((b / name).read_text()), name


@pytest.fixture(scope="module")
def minimax_m2_export(minimax_m2_ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("minimax_m2_export") / "export"
    assert _ptq("--pyt_ckpt_path", minimax_m2_ckpt, "--export_path", out) == 0
    return out


@pytest.mark.slow
def test_hf_ptq_nvfp4_quantizes_the_experts_only_under_the_hub_names(minimax_m2_ckpt, minimax_m2_export):
    """``--qformat nvfp4`` is the family's published split: routed experts NVFP4 (w1/w3 sharing weight_scale_2 and
    input_scale, every engine's w13), attention written dequantized BF16, router and bias fp32 as stored."""
    out = minimax_m2_export
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())
    assert hf_quant["modelopt_k3"]["recipe"] == "models/MiniMaxAI/MiniMax-M2/nvfp4"
    assert hf_quant["quantization"]["quant_algo"] == "NVFP4"
    tensors, src = read_export(out), stored(minimax_m2_ckpt)
    expert = "model.layers.1.block_sparse_moe.experts.3"
    assert tensors[f"{expert}.w1.weight"].dtype == torch.uint8
    for field in ("weight_scale_2", "input_scale"):
        assert torch.equal(tensors[f"{expert}.w1.{field}"], tensors[f"{expert}.w3.{field}"])
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    for key in ("model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.block_sparse_moe.e_score_correction_bias"):
        assert tensors[key].dtype == torch.float32 and torch.equal(tensors[key], src[key])
    assert not any(k.endswith("_scale_inv") or ".mlp." in k for k in tensors)
    from modelopt_k3.check import check_export
    from modelopt_k3.check.report import LOADS, NOT_VERIFIED

    verdicts = {e: r.verdict for e, r in check_export(out, ("vllm", "sglang", "trtllm")).results.items()}
    assert verdicts == {"vllm": LOADS, "sglang": LOADS, "trtllm": NOT_VERIFIED}  # TensorRT-LLM's loader: not read


@pytest.mark.slow
def test_layerwise_equals_resident(minimax_m2_ckpt, minimax_m2_export, tmp_path):
    assert _ptq("--pyt_ckpt_path", minimax_m2_ckpt, "--export_path", tmp_path / "lw", "--layerwise") == 0
    _assert_same_export(tmp_path / "lw", minimax_m2_export)
