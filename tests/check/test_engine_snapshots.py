"""Engine rules re-read from one snapshot per engine (vLLM 0.33.0, SGLang 0.5.23, TensorRT-LLM cf328e85).

Each test builds the export a recipe would produce (``planned_layout``: names and headers only, the
same manifest writer as the exporters) on a tiny Kimi-K3, or edits that manifest to break one rule,
and asks the replay. A 128-aligned tiny variant stands for Kimi-K3's dimensions where the engines'
block-FP8 kernels need multiples of 128 (the default tiny model is 64 wide).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from modelopt_k3.check import DIFFERENT, LOADS, REFUSES, check_layout, planned_layout
from modelopt_k3.cli import check as check_cli
from modelopt_k3.cli import convert as convert_cli
from modelopt_k3.cli import hf_ptq
from modelopt_k3.recipe import load_recipe, recipe_from_dict
from modelopt_k3.testing import make_tiny_kimi_k3

pytestmark = pytest.mark.slow  # a tiny checkpoint of its own, and whole-export CLI runs

MIRROR = "models/moonshotai/Kimi-K3/nvfp4_experts-fp8_pb_attention"
EXPERTS = "models/moonshotai/Kimi-K3/nvfp4_experts"
ENGINES = ("vllm", "sglang", "trtllm")
LM = "language_model.model"
# Every Linear dimension the mirror quantizes a multiple of 128, as in Kimi-K3 (routed experts too; MLA kv_b_proj
# has num_heads x (qk_nope_head_dim + v_head_dim) rows, which TensorRT-LLM's FP8 read needs 128-aligned as well).
ALIGNED = {"linear_head_dim": 128, "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 128, "v_head_dim": 128,
           "moe_intermediate_size": 128, "routed_expert_hidden_size": 128}


@pytest.fixture(scope="module")
def tiny128(tmp_path_factory) -> Path:
    return make_tiny_kimi_k3(tmp_path_factory.mktemp("tiny128") / "ckpt", seed=0, **ALIGNED)


def _verdicts(layout) -> dict[str, str]:
    return {e: r.verdict for e, r in check_layout(layout, ENGINES, numerics=False).results.items()}


def _with_layers(layout, edit):
    """A copy of ``layout`` whose quantized_layers (both configs) ``edit`` rewrote."""
    layout = copy.deepcopy(layout)
    layers = edit(layout.hf_quant["quantization"]["quantized_layers"])
    layout.hf_quant["quantization"]["quantized_layers"] = layout.quant["quantized_layers"] = layers
    return layout


def test_the_mirror_at_kimi_k3s_alignment_loads_in_every_engine(tiny128: Path):
    layout = planned_layout(tiny128, load_recipe(MIRROR))
    report = check_layout(layout, ENGINES, numerics=False)
    assert {e: r.verdict for e, r in report.results.items()} == dict.fromkeys(ENGINES, LOADS), report.table()
    # SGLang: NVFP4 experts with the situ activation need the flashinfer_trtllm runner; rows align here.
    assert report.results["sglang"].serve_flags == [
        "--moe-runner-backend flashinfer_trtllm (ModelOpt NVFP4 MoE takes the situ activation only on "
        "flashinfer_trtllm/flashinfer_megamoe; the default auto fails at the first forward)"]


def test_sglang_needs_the_runtime_spellings_without_language_model(tiny128: Path):
    """SGLang 0.5.23 names K3 modules ``model.layers...mlp...`` and never adds ``language_model.`` back: a
    manifest spelled only with checkpoint names builds every module BF16 and refuses the FP8/NVFP4 tensors."""
    layout = planned_layout(tiny128, load_recipe(MIRROR))
    hf_only = _with_layers(layout, lambda layers: {k: v for k, v in layers.items() if k.startswith("language_model.")})
    verdicts = _verdicts(hf_only)
    assert verdicts == {"vllm": LOADS, "sglang": REFUSES, "trtllm": LOADS}
    sglang = check_layout(hf_only, ("sglang",), numerics=False).results["sglang"]
    assert "no quantized_layers entry" in sglang.refusals[0].reason
    # With model.* spellings but no mlp one, SGLang's mapper (block_sparse_moe -> mlp) still finds the banks.
    no_mlp = _with_layers(layout, lambda layers: {k: v for k, v in layers.items() if ".mlp." not in k})
    assert _verdicts(no_mlp) == dict.fromkeys(ENGINES, LOADS)


def test_vllm_dispatches_fp8_pb_wo_in_its_mixed_config(tiny128: Path):
    """vLLM 0.33.0 LINEAR_ALGOS has FP8_PB_WO; a per-tensor-FP8 label on the same tensors is refused."""
    layout = planned_layout(tiny128, load_recipe(MIRROR))
    relabeled = _with_layers(layout, lambda layers: {
        k: ({"quant_algo": "FP8"} if v["quant_algo"] == "FP8_PB_WO" else v) for k, v in layers.items()})
    vllm = check_layout(relabeled, ("vllm",), numerics=False).results["vllm"]
    assert vllm.verdict == REFUSES and "stored fp8_pb, but vllm builds" in vllm.refusals[0].reason


def test_kda_projections_nvfp4_are_refused_by_vllm_and_sglang(tiny128: Path):
    recipe = recipe_from_dict({"quant_cfg": [
        {"pattern": "*.block_sparse_moe.experts*", "weights": "nvfp4", "inputs": "nvfp4"},
        {"import": "units/default_disabled"},
        {"pattern": "*.layers.0.self_attn.*_proj", "weights": "nvfp4", "inputs": "nvfp4"},
    ]}, name="kda_nvfp4")
    report = check_layout(planned_layout(tiny128, recipe), ENGINES, numerics=False)
    vllm, sglang, trt = (report.results[e] for e in ENGINES)
    assert vllm.verdict == REFUSES and any("in_proj_qkvgfab" in r.reason and "pads it per TP rank" in r.reason
                                           for r in vllm.refusals), vllm.details()
    assert sglang.verdict == REFUSES and any("[f_a | b] GEMM operand" in r.reason for r in sglang.refusals)
    assert trt.verdict == REFUSES and "reads only BF16 or FP8" in trt.refusals[0].reason


def test_sglang_mixed_precision_needs_quant_method_modelopt_mixed(tiny128: Path):
    layout = copy.deepcopy(planned_layout(tiny128, load_recipe(EXPERTS)))
    layout.quant["quant_method"] = "modelopt"
    sglang = check_layout(layout, ("sglang",), numerics=False).results["sglang"]
    assert sglang.verdict == REFUSES and "only for quant_method 'modelopt_mixed'" in sglang.refusals[0].reason


def test_trtllm_is_a_target_for_the_mirror_and_the_experts_recipe(tiny_ckpt: Path, tiny128: Path, tmp_path: Path,
                                                                  capsys):
    """Acceptance of issue 17 part 2: the converter's and hf_ptq's exports. The mirror's FP8 attention needs
    Kimi-K3's 128-aligned dims in TensorRT-LLM's newest K3 loader (FP8 KDA projections, MLA kv_b_proj), so it
    is built on the 128-aligned tiny model; the default tiny model's mirror is refused there."""
    for recipe, src in ((MIRROR, tiny128), (EXPERTS, tiny_ckpt)):
        out = tmp_path / recipe.rsplit("/", 1)[1]
        assert convert_cli.main(["--src", str(src), "--dst", str(out), "--recipe", recipe,
                                 "--target_engines", "trtllm", "--no_progress"]) == 0
        assert check_cli.main([str(out), "--engine", "trtllm"]) == 0
    assert convert_cli.main(["--src", str(tiny_ckpt), "--dst", str(tmp_path / "mirror64"), "--recipe", MIRROR,
                             "--target_engines", "trtllm", "--no_progress"]) != 0
    out = tmp_path / "hf_ptq_mirror"
    assert hf_ptq.main(["--pyt_ckpt_path", str(tiny128), "--trust_remote_code", "--recipe", MIRROR,
                        "--export_path", str(out), "--target_engines", "trtllm", "--no_progress"]) == 0
    assert check_cli.main([str(out), "--engine", "trtllm"]) == 0
    capsys.readouterr()
    # One writer: both exporters write exactly the manifest the plan declares (the golden test's subject).
    planned = planned_layout(tiny128, load_recipe(MIRROR))
    for export in (tmp_path / "nvfp4_experts-fp8_pb_attention", out):
        assert json.loads((export / "hf_quant_config.json").read_text()) == planned.hf_quant
        assert json.loads((export / "config.json").read_text())["quantization_config"] == planned.quant
    # The preset named for it: what TensorRT-LLM serves, served by the other two as well once the routed
    # experts are 128-wide (SGLang's flashinfer shuffle refuses the default tiny model's 64-row GEMM2).
    layout = planned_layout(tiny_ckpt, load_recipe("trtllm"))
    assert _verdicts(layout) == {"vllm": LOADS, "sglang": REFUSES, "trtllm": LOADS}
    assert _verdicts(planned_layout(tiny128, load_recipe("trtllm"))) == dict.fromkeys(ENGINES, LOADS)


def test_sglang_reads_a_single_format_w4a16_nvfp4_manifest(tiny128: Path):
    """SGLang 0.5.23's ModelOptFp4Config takes W4A16_NVFP4 (FP8, NVFP4, NVFP4_AWQ, W4A16_NVFP4); its routed experts
    then run on flashinfer_trtllm (K3's situ needs it), whose activation scales stay the 1.0 fill: the export
    loads but serves different numbers."""
    from modelopt_k3.export.modelopt_format import config_quantization_config, hf_quant_config

    recipe = recipe_from_dict({"quant_cfg": [
        {"pattern": "*.block_sparse_moe.experts*", "weights": "nvfp4", "inputs": None},
        {"import": "units/default_disabled"},
    ]}, name="experts_w4a16")
    layout = copy.deepcopy(planned_layout(tiny128, recipe))
    experts = [n for n, lin in layout.linears.items() if lin.fmt == "w4a16_nvfp4"]
    unquantized = [n for n, lin in layout.linears.items() if lin.fmt == "bf16"]
    layout.hf_quant = hf_quant_config(dict.fromkeys(experts, "W4A16_NVFP4"), kv_cache=None, unquantized=unquantized)
    layout.quant = config_quantization_config(layout.hf_quant)
    assert layout.quant["quant_algo"] == "W4A16_NVFP4"
    sglang = check_layout(layout, ("sglang",), numerics=False).results["sglang"]
    assert sglang.verdict == DIFFERENT and not sglang.refusals, sglang.headline()
    assert all("fill value 1.0" in d.what for d in sglang.deviations) and len(sglang.deviations) == 3
    layout.quant["quant_algo"] = "NVFP4_GPTQ"
    assert "supports only FP8, NVFP4" in check_layout(layout, ("sglang",), numerics=False).results["sglang"].headline()


def _trt(layout) -> list:
    result = check_layout(layout, ("trtllm",), numerics=False).results["trtllm"]
    return result.refusals


def test_trtllm_newest_k3_loader_refuses_the_three_manifest_edits(tiny128: Path):
    """TensorRT-LLM's newest K3 loader (models/kimi_k3/serving.py): the aligned mirror loads; each manifest edit
    issue 30's replay found raising is refused -- attention declared other than unquantized/FP8_BLOCK_SCALES (or
    aliases disagreeing), KDA q/k/v/g/o not FP8 all together, a routed-expert bank in exclude_modules."""
    mirror = planned_layout(tiny128, load_recipe(MIRROR))
    assert _trt(mirror) == []
    (warning,) = check_layout(mirror, ("trtllm",), numerics=False).results["trtllm"].warnings
    assert "config.json: quantization_config has no group_size" in warning
    mla, kda = f"{LM}.layers.3.self_attn", f"{LM}.layers.2.self_attn"

    def declare(algo, names):
        return lambda layers: {**layers, **{n: {"quant_algo": algo} for n in names}}

    refused = _trt(_with_layers(mirror, declare("FP8", [f"{mla}.q_b_proj", "model.layers.3.self_attn.q_b_proj",
                                                        "layers.3.self_attn.q_b_proj"])))
    assert [r.tensor for r in refused] == [f"{mla}.q_b_proj.weight"] and "declared FP8" in refused[0].reason
    refused = _trt(_with_layers(mirror, declare("NVFP4", ["model.layers.3.self_attn.q_b_proj"])))  # one alias only
    assert [r.tensor for r in refused] == [f"{mla}.q_b_proj.weight"] and "Conflicting" in refused[0].reason
    # FP8_BLOCK_SCALES entries with another group_size than 128 (the replay's manifest-attn-fp8-group64 cell).
    group64 = _with_layers(mirror, lambda layers: {k: {**v, "group_size": 64} if "layers.2.self_attn." in k else v
                                                   for k, v in layers.items()})
    refused = _trt(group64)
    assert [r.tensor for r in refused] == [f"{kda}.q_proj.weight"] and "128x128 FP8 blocks" in refused[0].reason
    without_g = _with_layers(mirror, lambda layers: {k: v for k, v in layers.items() if not k.endswith("2.self_attn.g_proj")})
    refused = _trt(without_g)
    assert [r.tensor for r in refused] == [f"{kda}.q_proj.weight"] and "all together or none" in refused[0].reason
    banked = copy.deepcopy(mirror)
    banked.hf_quant["quantization"]["exclude_modules"].append(f"{LM}.layers.2.block_sparse_moe.experts")
    refused = _trt(banked)
    assert [r.tensor for r in refused] == [f"{LM}.layers.2.block_sparse_moe.experts.0.w1.weight"]
    assert "NotImplementedError" in refused[0].reason and "before quantized_layers" in refused[0].reason
    # The same bank as a subtree, ``<bank>.*``: TensorRT-LLM's QuantConfig matches the bank itself too (the
    # replay's manifest-bank-excluded-subtree cell; the check had said "loads").
    subtree = copy.deepcopy(mirror)
    subtree.hf_quant["quantization"]["exclude_modules"].append(f"{LM}.layers.2.block_sparse_moe.experts.*")
    refused = _trt(subtree)
    assert [r.tensor for r in refused] == [f"{LM}.layers.2.block_sparse_moe.experts.0.w1.weight"]
