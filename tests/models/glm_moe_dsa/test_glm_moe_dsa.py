"""GLM-5 on the generic transformers-native spec: logits equal to transformers' own model (the DSA indexer run on
CPU), the MTP layer carried as stored, and ``hf_ptq`` with the default recipe (resident, layerwise)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _exports import read_export
from _standins import stored

from modelopt_k3.testing.glm_moe_dsa import calibration_token_ids

PTQ = ["--qformat", "nvfp4", "--calib_size", "8", "--batch_size", "4", "--calib_seq", "32", "--no_progress",
       "--report", "none"]


def _logits(ckpt: Path, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    import modelopt_k3

    model = modelopt_k3.load_pretrained(ckpt, dtype=dtype, progress=False)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, experts_implementation="eager")
    ours_dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert ours_dtypes == {n: p.dtype for n, p in ref.named_parameters()}  # fp32 router, bias, indexer weights
    ids = calibration_token_ids()
    assert ids.shape[1] > model.config.index_topk  # the indexer's selection matters
    with torch.no_grad():
        return model(input_ids=ids).logits, ref(input_ids=ids).logits


def test_logits_equal_transformers_bit_for_bit(glm_ckpt):
    """bf16: our load (experts fused and re-classed, the MTP layer not built) gives transformers' own
    GlmMoeDsaForCausalLM's logits bit for bit, the indexer's top-k included."""
    ours, theirs = _logits(glm_ckpt, torch.bfloat16)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)


@pytest.mark.slow
def test_fp32_logits_within_1e_5(glm_ckpt):
    ours, theirs = _logits(glm_ckpt, torch.float32)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def _ptq(*argv) -> int:
    from modelopt_k3.cli import hf_ptq

    return hf_ptq.run(hf_ptq.build_parser().parse_args([*PTQ, *map(str, argv)]))


@pytest.fixture(scope="module")
def glm_export(glm_ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("glm_export") / "export"
    assert _ptq("--pyt_ckpt_path", glm_ckpt, "--export_path", out) == 0
    return out


@pytest.mark.slow
def test_hf_ptq_nvfp4_quantizes_routed_experts_and_carries_the_mtp_layer(glm_ckpt, glm_export, tmp_path):
    """``--qformat nvfp4``: routed experts NVFP4; attention, the DSA indexer, shared experts, the dense layer and the
    MTP layer (``model.layers.3``, every tensor as stored) BF16 and excluded; vLLM and SGLang load it with their
    DeepSeek-V2 loader (MTP layers to the drafter) once config.json has the release's router keys, TensorRT-LLM not
    verified."""
    out = glm_export
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())
    assert hf_quant["modelopt_k3"]["recipe"] == "models/zai-org/GLM-5/nvfp4"
    exclude = hf_quant["quantization"]["exclude_modules"]
    assert {"model.layers.3*", "model.layers.1.self_attn*", "model.layers.0*"} <= set(exclude)
    tensors, src = read_export(out), stored(glm_ckpt)
    assert tensors["model.layers.2.mlp.experts.5.gate_proj.weight"].dtype == torch.uint8
    for key in ("model.layers.2.self_attn.indexer.wq_b.weight", "model.layers.2.mlp.shared_experts.up_proj.weight"):
        assert tensors[key].dtype == torch.bfloat16 and torch.equal(tensors[key], src[key])
    mtp = {k for k in src if k.startswith("model.layers.3.")}
    assert mtp and all(torch.equal(tensors[k], src[k]) for k in mtp)
    from modelopt_k3.check import check_export
    from modelopt_k3.check.report import LOADS, NOT_VERIFIED, REFUSES
    from tools.conformance.matrix import GLM5_RELEASE_CONFIG, copy_with

    # The stand-in's config.json is transformers' (no topk_method / moe_layer_freq): both engines refuse it, as their
    # own loaders did (tests/data/engine_conformance.json); with the release config's keys both load it.
    report = check_export(out, ("vllm", "sglang", "trtllm"))
    assert {e: r.verdict for e, r in report.results.items()} == {"vllm": REFUSES, "sglang": REFUSES,
                                                                  "trtllm": NOT_VERIFIED}
    assert "topk_method" in report.results["vllm"].refusals[0].reason
    assert "moe_layer_freq" in report.results["sglang"].refusals[0].reason
    release = copy_with(out, tmp_path / "release", config=lambda cfg: cfg.update(GLM5_RELEASE_CONFIG))
    verdicts = {e: r.verdict for e, r in check_export(release, ("vllm", "sglang", "trtllm")).results.items()}
    assert verdicts == {"vllm": LOADS, "sglang": LOADS, "trtllm": NOT_VERIFIED}


@pytest.mark.slow
def test_layerwise_equals_resident(glm_ckpt, glm_export, tmp_path):
    assert _ptq("--pyt_ckpt_path", glm_ckpt, "--export_path", tmp_path / "lw", "--layerwise") == 0
    ta, tb = read_export(tmp_path / "lw"), read_export(glm_export)
    assert set(ta) == set(tb)
    assert [k for k in ta if not torch.equal(ta[k].reshape(-1).view(torch.uint8), tb[k].reshape(-1).view(torch.uint8))] == []
    for name in ("config.json", "hf_quant_config.json"):
        assert json.loads((tmp_path / "lw" / name).read_text()) == json.loads((glm_export / name).read_text())
