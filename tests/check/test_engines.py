"""``modelopt-k3-check``: replaying vLLM's, SGLang's and TensorRT-LLM's Kimi-K3 loading of an export.

* An engine-emulating reader (``engine_emulation.vllm_reading``) dequantizes an export the way vLLM's
  Kimi-K3 class does and must reproduce the fake-quantized model's logits when the check passes, and
  must not when the check reports different numbers.
* Exports that break one rule on purpose (built here from a good export, so these tests do not depend
  on what today's exporter writes) must get the right verdict and reason.
* The up-front recipe check and the CLIs' exit codes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_emulation import (
    edit_export,
    quantized_modules,
    set_exclude,
    vllm_reading,
)
from export.test_model_export import (
    HELD_OUT,
    SEQ,
    load_f32,
    logits_of,
    read_export,
    reference_from_export,
    rel_err,
)

from modelopt_k3 import check_export, export_checkpoint, quantize
from modelopt_k3.check import (
    DIFFERENT,
    LOADS,
    REFUSES,
    EngineRefusal,
    check_recipe_for_engines,
    final_check,
    planned_layout,
    scan_export,
)
from modelopt_k3.cli import check as check_cli
from modelopt_k3.cli import convert as convert_cli
from modelopt_k3.cli import hf_ptq
from modelopt_k3.export.modelopt_format import (
    config_quantization_config,
    hf_quant_config,
    summarize_exclusions,
)
from modelopt_k3.quant.schemes import NVFP4_TENSOR
from modelopt_k3.recipe import load_recipe, recipe_from_dict
from modelopt_k3.testing.reference import read_checkpoint

pytestmark = [pytest.mark.usefixtures("restore_remote_code"), pytest.mark.slow]  # exports and engine-emulating reads of whole models

LM = "language_model.model"
MLP0 = f"{LM}.layers.0.mlp"
EXPERTS1 = f"{LM}.layers.1.block_sparse_moe.experts"
MLA3 = f"{LM}.layers.3.self_attn"


@pytest.fixture(scope="module")
def tokenizer(tiny_wide_ckpt: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_wide_ckpt, trust_remote_code=True)


@pytest.fixture(scope="module")
def held_out_ids(tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"][:SEQ] for t in HELD_OUT])


@pytest.fixture(scope="module")
def experts_only(tiny_wide_ckpt: Path, tokenizer, held_out_ids, tmp_path_factory):
    """nvfp4_experts_only, calibrated W4A4 (fp32): (export dir, fake-quant logits on held-out text)."""
    from modelopt_k3.data import load_texts, make_forward_loop, pack_sequences

    seqs = pack_sequences(tokenizer, load_texts("builtin"), num_sequences=4, seq_len=SEQ)
    loop = make_forward_loop(list(seqs.split(4)), device=torch.device("cpu"), progress=False)
    model = quantize(load_f32(tiny_wide_ckpt), "nvfp4_experts_only", loop, verbose=False)
    logits = logits_of(model, held_out_ids)
    out = export_checkpoint(model, tmp_path_factory.mktemp("experts_only") / "export", progress=False)
    return out, logits


def _single_format(hf: dict, cfg: dict, quantized: set[str], unquantized: list[str]) -> None:
    """Rewrite both configs in place as ModelOpt's single-format NVFP4 manifest (the one writer without a
    model's naming) for ``quantized`` modules."""
    new_hf = hf_quant_config(dict.fromkeys(quantized, "NVFP4"), kv_cache=None, unquantized=unquantized)
    hf.clear()
    hf.update(new_hf["quantization"])
    cfg.clear()
    cfg.update(config_quantization_config(new_hf))


@pytest.fixture(scope="module")
def good(experts_only, tmp_path_factory) -> Path:
    """The experts-only export as a single-format NVFP4 manifest (vLLM's and SGLang's single-algo ModelOpt
    configs, which the broken-one-rule exports below each break once), its exclude list summarized from the
    exact names of its BF16 Linears as ModelOpt does (prefix wildcards: what the engines need to leave the
    fused attention parameters BF16), so the good case is built here whatever the exporter writes."""
    src, _ = experts_only
    quantized = quantized_modules(src)
    return edit_export(src, tmp_path_factory.mktemp("good") / "export",
                       quant=lambda hf, cfg: _single_format(hf, cfg, quantized, _exact_excludes(src)))


def verdicts(report) -> dict[str, str]:
    return {name: r.verdict for name, r in report.results.items()}


# ----------------------------------------------------------------------------- the engine-emulating reader


def test_vllm_reading_of_a_passing_export_gives_the_fake_quant_logits(good: Path, experts_only, held_out_ids):
    _, fake_quant_logits = experts_only
    assert verdicts(check_export(good, ("vllm", "sglang"))) == {"vllm": LOADS, "sglang": LOADS}
    engine_rb, kv = vllm_reading(read_export(good))
    assert not kv
    err = rel_err(logits_of(reference_from_export(engine_rb), held_out_ids), fake_quant_logits)
    print(f"vLLM reading vs fake-quant relative logits error {err:.3g}")
    assert err < 2e-3, err  # the bound of export.test_model_export's W4A4 reader test (measured 0 there)


def test_vllm_reading_of_unshared_w1_w3_scales_differs_and_the_check_says_so(good: Path, held_out_ids, tmp_path):
    """An expert whose w3 global scale differs from w1's: vLLM reads w3 with w1's (a warning, no error)."""
    w3 = f"{EXPERTS1}.2.w3.weight_scale_2"
    written = read_export(good).tensors[w3]
    bad = edit_export(good, tmp_path / "bad", add={w3: written * 2})
    report = check_export(bad, ("vllm", "sglang"))
    assert verdicts(report) == {"vllm": DIFFERENT, "sglang": DIFFERENT}
    (dev,) = report.results["vllm"].deviations
    assert dev.module == EXPERTS1 and "w1/w3 weight_scale_2 differ" in dev.what and "expert 2" in dev.what
    assert dev.rule == "w13-scale-2-read-with-w1s"  # vLLM #54974 (docs/SERVING_RULES.md)
    assert dev.error == pytest.approx(0.5)  # read as s1 = s3 / 2
    rb = read_export(bad)
    engine_rb, _ = vllm_reading(rb)
    as_written = logits_of(reference_from_export(rb), held_out_ids)
    assert rel_err(logits_of(reference_from_export(engine_rb), held_out_ids), as_written) > 1e-3


# ----------------------------------------------------------------------------- one rule broken at a time


def _mlp0_nvfp4(tiny_wide_ckpt: Path, *, shared: bool) -> dict[str, torch.Tensor]:
    """Layer 0's dense MLP as NVFP4 W4A4 tensors: gate/up with one global scale (``shared``) or their own."""
    src = read_checkpoint(tiny_wide_ckpt)
    weights = {p: src[f"{MLP0}.{p}.weight"].float() for p in ("gate_proj", "up_proj", "down_proj")}
    own = {p: w.abs().amax() / (6 * 448) for p, w in weights.items()}
    group = torch.maximum(own["gate_proj"], own["up_proj"])
    out = {}
    for proj, w in weights.items():
        scale = group if shared and proj != "down_proj" else own[proj]
        for suffix, t in NVFP4_TENSOR.weight_tensors(w, scale).items():
            out[f"{MLP0}.{proj}.{suffix}"] = t
        out[f"{MLP0}.{proj}.input_scale"] = torch.tensor(0.01 if proj != "down_proj" else 0.02)
    return out


def _with_mlp0(good: Path, dst: Path, tiny_wide_ckpt: Path, *, shared: bool) -> Path:
    tensors = _mlp0_nvfp4(tiny_wide_ckpt, shared=shared)
    quantized = quantized_modules(good) | {k.rpartition(".")[0] for k in tensors}
    src_excluded = [f"{MLP0}.{p}" for p in ("gate_proj", "up_proj", "down_proj")]

    base = [m for m in _exact_excludes(good) if m not in src_excluded]
    return edit_export(good, dst, add=tensors, quant=lambda hf, cfg: set_exclude(
        hf, cfg, summarize_exclusions(base, quantized)))


def _exact_excludes(export: Path) -> list[str]:
    """Every Linear the export leaves unquantized, by exact name."""
    layout, reader = scan_export(export)
    reader.close()
    return sorted(n for n, lin in layout.linears.items() if lin.fmt == "bf16")


def test_fused_group_with_one_global_scale_loads_correctly(good: Path, tiny_wide_ckpt: Path, tmp_path):
    export = _with_mlp0(good, tmp_path / "shared", tiny_wide_ckpt, shared=True)
    assert verdicts(check_export(export, ("vllm", "sglang"))) == {"vllm": LOADS, "sglang": LOADS}


def test_unshared_group_scale_serves_different_numbers(good: Path, tiny_wide_ckpt: Path, tmp_path):
    export = _with_mlp0(good, tmp_path / "unshared", tiny_wide_ckpt, shared=False)
    tensors = read_export(export).tensors
    gate, up = (tensors[f"{MLP0}.{p}.weight_scale_2"].item() for p in ("gate_proj", "up_proj"))
    report = check_export(export, ("vllm", "sglang"))
    assert verdicts(report) == {"vllm": DIFFERENT, "sglang": DIFFERENT}
    for engine in ("vllm", "sglang"):
        (dev,) = report.results[engine].deviations
        assert dev.module == f"{MLP0}.gate_up_proj" and "weight_scale_2 differ across gate_proj, up_proj" in dev.what
        assert dev.error == pytest.approx(max(gate, up) / min(gate, up) - 1, rel=1e-6)
        assert dev.error > 0
    printed: list[str] = []
    assert final_check(export, (), say=printed.append) == 0  # printed, but no engine was targeted
    # Untargeted engines get their verdict line and the command that gives their details.
    assert "weight_scale_2 differ" in printed[0] and "\nvllm:" not in printed[0]
    assert printed[1] == f"(details: modelopt-k3-check {export} --engine vllm,sglang,trtllm)"
    printed.clear()
    assert final_check(export, ("sglang",), say=printed.append) == 1
    assert "\nsglang:" in printed[0] and "\nvllm:" not in printed[0]
    assert printed[1] == f"(details: modelopt-k3-check {export} --engine vllm,trtllm)"


@pytest.fixture(scope="module")
def mlp0_fp8_pb(tiny_wide_ckpt: Path, tmp_path_factory) -> Path:
    """Calibration-free: layer 0's dense MLP as 128x128 block FP8 (dims divisible by 128), the rest BF16."""
    recipe = recipe_from_dict({"quant_cfg": [{"pattern": f"{MLP0}.*", "weights": "fp8_pb", "inputs": None}]},
                              name="mlp0_fp8_pb")
    from modelopt_k3 import convert_checkpoint

    out = tmp_path_factory.mktemp("fp8_pb") / "export"
    convert_checkpoint(tiny_wide_ckpt, out, recipe, progress=False)
    return out


def _fp8_pb_with_scale_rank(src: Path, dst: Path, rank: int) -> Path:
    """The FP8_PB_WO export with its block scales written ``[nr, 1, nc, 1]`` (rank 4) or ``[nr, nc]``."""
    _, reader = scan_export(src)
    with reader:
        scales = {f"{MLP0}.{p}.weight_scale": reader.get(f"{MLP0}.{p}.weight_scale") for p in ("gate_proj", "up_proj", "down_proj")}
    add = {}
    for key, s in scales.items():
        nr, nc = (s.shape[0], s.shape[2]) if s.dim() == 4 else s.shape
        add[key] = s.reshape(nr, 1, nc, 1) if rank == 4 else s.reshape(nr, nc)
    quantized = {k.rpartition(".")[0] for k in scales}
    return edit_export(src, dst, add=add, quant=lambda hf, cfg: set_exclude(
        hf, cfg, summarize_exclusions(_exact_excludes(src), quantized)))


def test_fp8_pb_wo_needs_modelopts_4d_block_scale(mlp0_fp8_pb: Path, tmp_path):
    good4 = _fp8_pb_with_scale_rank(mlp0_fp8_pb, tmp_path / "4d", 4)
    bad2 = _fp8_pb_with_scale_rank(mlp0_fp8_pb, tmp_path / "2d", 2)
    assert json.loads((good4 / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "FP8_PB_WO"
    good_report, bad_report = check_export(good4, ("vllm", "sglang")), check_export(bad2, ("vllm", "sglang"))
    assert good_report.results["vllm"].verdict == LOADS
    vllm = bad_report.results["vllm"]
    assert vllm.verdict == REFUSES
    first = vllm.refusals[0]
    assert first.tensor == f"{MLP0}.down_proj.weight" and "weight_scale is float32 [1, 2]" in first.reason
    assert "shape [1, 1, 2, 1]" in first.reason
    # SGLang's ModelOpt FP8 config reads every FP8* algo as per-tensor FP8: refused either way.
    for report in (good_report, bad_report):
        sglang = report.results["sglang"]
        assert sglang.verdict == REFUSES and "stored fp8_pb, but sglang builds" in sglang.refusals[0].reason


@pytest.mark.parametrize("name", ["k_scale", "k_proj.k_scale"])
def test_kv_scales_are_dropped_by_both_kimi_k3_classes(good: Path, tmp_path, name: str):
    """The old ``self_attn.k_scale`` and ModelOpt's ``self_attn.k_proj.k_scale`` both remap to
    ``self_attn.attn.k_scale``, a parameter neither engine's Kimi-K3 MLA has: served with 1.0."""
    v_name = name.replace("k", "v")
    add = {f"{MLA3}.{name}": torch.tensor(0.25), f"{MLA3}.{v_name}": torch.tensor(0.25)}

    def kv(hf, cfg):
        hf["kv_cache_quant_algo"] = "FP8"
        cfg["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "dynamic": False}

    export = edit_export(good, tmp_path / "kv", add=add, quant=kv)
    report = check_export(export, ("vllm", "sglang"))
    assert verdicts(report) == {"vllm": DIFFERENT, "sglang": DIFFERENT}
    # vLLM: AutoWeightsLoader's cache-scale mapper first, then the model's maybe_remap_kv_scale_name on that name.
    vllm_attn = (f"{MLA3}.attn.k_scale (AutoWeightsLoader's cache-scale mapper) and then {MLA3}.attn.attn.k_scale "
                 "(maybe_remap_kv_scale_name)")
    for engine, attn in (("vllm", vllm_attn), ("sglang", "model.layers.3.self_attn.attn.k_scale")):
        dev = next(d for d in report.results[engine].deviations if d.module == f"{MLA3}.{name}")
        assert f"remaps it to {attn}, which is no parameter" in dev.what and "dropped" in dev.what
        assert "scale 1.0, not 0.25" in dev.what and dev.error == pytest.approx(3.0)
    _, kv_targets = vllm_reading(read_export(export))
    assert kv_targets == {f"{MLA3}.{name}": None, f"{MLA3}.{v_name}": None}


def test_layers_an_engines_k3_class_cannot_take_quantized(good: Path, tiny_wide_ckpt: Path, tmp_path):
    src = read_checkpoint(tiny_wide_ckpt)

    def nvfp4(module: str) -> dict[str, torch.Tensor]:
        w = src[f"{module}.weight"].float()
        t = NVFP4_TENSOR.weight_tensors(w, w.abs().amax() / (6 * 448))
        return {f"{module}.{k}": v for k, v in {**t, "input_scale": torch.tensor(0.01)}.items()}

    def export_with(module: str, dst: Path) -> Path:
        quantized = quantized_modules(good) | {module}
        base = [m for m in _exact_excludes(good) if m != module]
        return edit_export(good, dst, add=nvfp4(module), quant=lambda hf, cfg: set_exclude(
            hf, cfg, summarize_exclusions(base, quantized)))

    latent = f"{LM}.layers.1.block_sparse_moe.routed_expert_down_proj"
    report = check_export(export_with(latent, tmp_path / "latent"), ("vllm", "sglang"))
    # SGLang 0.5.23 gives the latent projections a quant config only when it supports quantized latent
    # projections (ModelOpt's does not); vLLM 0.33.0 builds them with its quant config.
    first = report.results["sglang"].refusals[0]
    assert first.tensor == f"{latent}.weight" and "quant_config=None" in first.reason, first
    assert report.results["vllm"].verdict == LOADS, report.results["vllm"].headline()

    kv_b = f"{MLA3}.kv_b_proj"
    report = check_export(export_with(kv_b, tmp_path / "kv_b"), ("vllm", "sglang"))
    sglang = report.results["sglang"]
    assert sglang.verdict == REFUSES and [r.tensor for r in sglang.refusals] == [f"{kv_b}.weight"]
    assert "w_kc/w_vc from kv_b_proj.weight, dequantizing only block FP8" in sglang.refusals[0].reason
    # vLLM's MLA dequantizes kv_b_proj for its absorbed matrices; with kv_b quantized the exclude list names
    # q_a/kv_a/g exactly, which leaves fused_qkv_a_g_proj BF16 because 0.33.0's packed_modules_mapping lists it.
    assert report.results["vllm"].verdict == LOADS, report.results["vllm"].headline()


def test_trtllm_reads_the_mxfp4_source_and_nvfp4_experts_only_when_declared(tiny_wide_ckpt: Path, good: Path, tmp_path):
    assert check_export(tiny_wide_ckpt, ("trtllm",)).results["trtllm"].verdict == LOADS  # the MXFP4 source form
    report = check_export(good, ("trtllm",)).results["trtllm"]
    assert report.verdict == REFUSES and "as W4A8_MXFP4_MXFP8 (the default" in report.refusals[0].reason

    def declare(hf, cfg):  # NVIDIA's Kimi-K3-NVFP4 layout: one entry per layer's experts module
        layers = {f"{LM}.layers.{i}.block_sparse_moe.experts": {"quant_algo": "NVFP4", "group_size": 16}
                  for i in (1, 2, 3)}
        for q in (hf, cfg):
            q["quant_algo"], q["quantized_layers"] = "MIXED_PRECISION", layers

    declared = edit_export(good, tmp_path / "declared", quant=declare)
    assert check_export(declared, ("trtllm",)).results["trtllm"].verdict == LOADS


MIRROR = "models/moonshotai/Kimi-K3/nvfp4_experts-fp8_pb_attention"
EXPERTS = "models/moonshotai/Kimi-K3/nvfp4_experts"


def test_sglang_refuses_64_wide_nvfp4_experts_at_flashinfers_shuffle(tiny_ckpt: Path, tmp_path):
    """SGLang 0.5.23's flashinfer_trtllm NVFP4 MoE post-processing (the backend K3's situ experts need)
    asserts routed-expert GEMM rows % 128 == 0: the default tiny model's GEMM2 has 64 (its GEMM1, 2 x 64, passes);
    vLLM pads the experts itself (the conformance matrix's 64-wide cells: SGLang AssertionError, vLLM loads)."""
    from modelopt_k3 import convert_checkpoint

    out = convert_checkpoint(tiny_ckpt, tmp_path / "experts", EXPERTS, progress=False).dst
    report = check_export(out, ("vllm", "sglang"))
    assert verdicts(report) == {"vllm": LOADS, "sglang": REFUSES}
    reasons = {r.reason for r in report.results["sglang"].refusals}
    assert reasons == {"SGLang's flashinfer_trtllm NVFP4 MoE post-processing (shuffle_matrix_sf_a) asserts routed-"
                       "expert GEMM rows % 128 == 0; this export has GEMM2 (w2) 64 (AssertionError after load_weights)"}
    assert [r.tensor for r in report.results["sglang"].refusals] == [
        f"{LM}.layers.{i}.block_sparse_moe.experts.0.w1.weight" for i in (1, 2, 3)]


def test_the_converters_mirror_loads_in_trtllm_and_the_tiny_dims_decide_vllm_and_sglang(tiny_ckpt: Path, tmp_path):
    """The mirror as the converter writes it: every engine dispatches its FP8_PB_WO attention (TensorRT-LLM's
    newest K3 loader reads it as FP8, banks declared NVFP4), but the 64-wide tiny model misses each engine's 128
    alignments -- TensorRT-LLM's for FP8 KDA projections and MLA kv_b_proj included (at 128-aligned sizes they
    load it: tests/check/test_engine_snapshots.py)."""
    from modelopt_k3 import convert_checkpoint

    mirror = convert_checkpoint(tiny_ckpt, tmp_path / "mirror", MIRROR, progress=False).dst
    assert check_cli.main([str(mirror), "--engine", "trtllm"]) == 1
    report = check_export(mirror, ("vllm", "sglang", "trtllm"))
    assert verdicts(report) == {"vllm": REFUSES, "sglang": REFUSES, "trtllm": REFUSES}
    trt_refused = {r.tensor.rsplit(".", 2)[-2] for r in report.results["trtllm"].refusals}
    assert trt_refused == {"q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "kv_b_proj"}, trt_refused
    assert all("multiples of 128" in r.reason for r in report.results["trtllm"].refusals)
    assert "FP8_PB_WO requires in divisible by 128, got 32" in report.results["vllm"].refusals[0].reason  # f_b_proj
    assert "validate_block_quant_shapes" in report.results["sglang"].refusals[0].reason  # fused_qkvg_proj
    (flag,) = report.results["sglang"].serve_flags
    assert flag.startswith("--moe-runner-backend flashinfer_trtllm")
    assert any("GEMM2 (w2) 64" in r.reason for r in report.results["sglang"].refusals)  # flashinfer's shuffle
    assert report.results["vllm"].serve_flags == [] and report.results["trtllm"].serve_flags == []

    def per_expert(hf, cfg):  # the bank entries replaced by per-expert ones: what TensorRT-LLM never reads
        layers = {k: v for k, v in hf["quantized_layers"].items() if not k.endswith(".experts")}
        layers.update({f"{LM}.layers.{i}.block_sparse_moe.experts.{e}.{p}": {"quant_algo": "NVFP4", "group_size": 16}
                       for i in (1, 2, 3) for e in range(8) for p in ("w1", "w2", "w3")})
        hf["quantized_layers"] = cfg["quantized_layers"] = layers

    trt = check_export(edit_export(mirror, tmp_path / "per_expert", quant=per_expert), ("trtllm",)).results["trtllm"]
    assert trt.verdict == REFUSES
    assert any("no <prefix>layers.{i}.block_sparse_moe.experts entry" in r.reason for r in trt.refusals)


def test_hf_quant_config_fallback_producer_matters_to_vllm_only(good: Path, tmp_path):
    """Without config.json's quantization_config both engines read hf_quant_config.json, but vLLM 0.33.0
    names the ModelOpt method only for producer.name "modelopt" (else builds the model unquantized and
    load_weights raises KeyError), while SGLang 0.5.23 names it from quant_algo alone (the conformance
    matrix's broken-no-quant-config cell: vLLM refuses, SGLang loads)."""
    export = edit_export(good, tmp_path / "no_qc")
    config = json.loads((export / "config.json").read_text())
    del config["quantization_config"]
    (export / "config.json").write_text(json.dumps(config))
    hf = json.loads((export / "hf_quant_config.json").read_text())
    for name, vllm_verdict in (("modelopt_k3", REFUSES), ("modelopt", LOADS)):
        hf["producer"]["name"] = name
        (export / "hf_quant_config.json").write_text(json.dumps(hf))
        report = check_export(export, ("vllm", "sglang"))
        assert report.results["vllm"].verdict == vllm_verdict, report.results["vllm"].headline()
        assert report.results["sglang"].verdict == LOADS, report.results["sglang"].headline()
    hf["producer"]["name"] = "modelopt_k3"
    (export / "hf_quant_config.json").write_text(json.dumps(hf))
    vllm = check_export(export, ("vllm",)).results["vllm"]
    assert "builds the model unquantized" in vllm.refusals[0].reason
    # SGLang's fallback reads a MIXED_PRECISION map without an NVFP4 layer as w4afp8, and names no method
    # for an algo outside FP4/FP8/MXFP8 (the model is built BF16)
    for quant, words in (({"quant_algo": "MIXED_PRECISION", "quantized_layers": {EXPERTS1: {"quant_algo": "FP8"}}},
                          "w4afp8"), ({"quant_algo": "FP8_PB_WO"}, "built unquantized")):
        (export / "hf_quant_config.json").write_text(json.dumps({**hf, "quantization": {**hf["quantization"], **quant}}))
        sglang = check_export(export, ("sglang",)).results["sglang"]
        assert sglang.verdict == REFUSES and words in sglang.refusals[0].reason, sglang.headline()


# ----------------------------------------------------------------------------- up front, from names only


def test_planned_layout_is_what_the_exporter_writes(experts_only, tiny_wide_ckpt: Path):
    """The up-front check judges exactly the tensors and configs the export will hold."""
    export, _ = experts_only
    planned = planned_layout(tiny_wide_ckpt, load_recipe("nvfp4_experts_only"))
    written, reader = scan_export(export)
    reader.close()
    assert planned.quant == written.quant and planned.hf_quant == written.hf_quant
    assert {n: lin.tensors for n, lin in planned.linears.items()} == {n: lin.tensors for n, lin in written.linears.items()}


LATENT_NVFP4 = {"quant_cfg": [
    {"pattern": "*.block_sparse_moe.experts*", "weights": "nvfp4", "inputs": "nvfp4"},
    {"import": "units/default_disabled"},
    {"pattern": "*.routed_expert_down_proj", "weights": "nvfp4", "inputs": "nvfp4"},
]}


def test_recipe_refused_up_front_names_layers_and_rule(tiny_wide_ckpt: Path):
    recipe = recipe_from_dict(LATENT_NVFP4, name="latent_nvfp4")
    with pytest.raises(EngineRefusal) as err:
        check_recipe_for_engines(tiny_wide_ckpt, recipe, "vllm,sglang")
    text = str(err.value)
    assert "cannot be served as calibrated by sglang:" in text
    assert f"{LM}.layers.1.block_sparse_moe.routed_expert_down_proj.weight" in text
    assert "builds the latent-expert projections with quant_config=None" in text
    kv = load_recipe("nvfp4_experts_only", overrides={"kv_cache": "fp8"})
    with pytest.raises(EngineRefusal, match=r"self_attn\.attn\.k_scale, which is no parameter"):
        check_recipe_for_engines(tiny_wide_ckpt, kv, ("sglang",))


def test_hf_ptq_refuses_before_loading(tiny_wide_ckpt: Path, tmp_path: Path, monkeypatch, capsys):
    import modelopt_k3.load

    def no_load(*a, **k):
        raise AssertionError("the recipe should have been refused before loading")

    monkeypatch.setattr(modelopt_k3.load, "load_pretrained", no_load)
    recipe = tmp_path / "latent.yaml"
    recipe.write_text(json.dumps(LATENT_NVFP4))  # JSON is YAML
    argv = ["--pyt_ckpt_path", str(tiny_wide_ckpt), "--trust_remote_code", "--recipe", str(recipe),
            "--export_path", str(tmp_path / "out"), "--no_progress"]
    assert hf_ptq.main([*argv, "--target_engines", "sglang"]) == 2
    err = capsys.readouterr().err
    assert "routed_expert_down_proj" in err and "quant_config=None" in err
    assert not (tmp_path / "out").exists()
    assert hf_ptq.main([*argv, "--target_engines", "tgi"]) == 2
    assert "unknown serving engine" in capsys.readouterr().err
    assert hf_ptq.main([*argv, "--target_engines", "sglang", "--export_format", "compressed-tensors"]) == 2


def test_convert_refuses_before_writing(tiny_wide_ckpt: Path, tmp_path: Path, capsys):
    mirror = "models/moonshotai/Kimi-K3/nvfp4_experts-fp8_pb_attention"
    rc = convert_cli.main(["--src", str(tiny_wide_ckpt), "--dst", str(tmp_path / "out"), "--recipe", mirror,
                           "--target_engines", "sglang", "--no_progress"])
    assert rc == 2 and not (tmp_path / "out").exists()
    # FP8_PB_WO fused_qkvg_proj: the tiny model's 64-row pieces are not 128-row partitions.
    assert "validate_block_quant_shapes refuses output partitions not divisible by 128" in capsys.readouterr().err


def test_check_cli_exit_codes(good: Path, tiny_wide_ckpt: Path, tmp_path: Path, capsys):
    assert check_cli.main([str(good)]) == 0
    out = capsys.readouterr().out
    assert "vllm    loads correctly" in out and "sglang  loads correctly" in out
    bad = _with_mlp0(good, tmp_path / "unshared", tiny_wide_ckpt, shared=False)
    assert check_cli.main([str(bad), "--engine", "vllm"]) == 1
    assert "loads but serves different numbers" in capsys.readouterr().out
    assert check_cli.main([str(tmp_path / "missing")]) == 2
    assert check_cli.main([str(good), "--engine", "vllm,tgi"]) == 2


def test_hf_ptq_prints_the_check_and_exits_on_targets_only(tiny_wide_ckpt: Path, tmp_path: Path, capsys):
    """Without --target_engines the final table is printed and the run succeeds whatever it says."""
    argv = ["--pyt_ckpt_path", str(tiny_wide_ckpt), "--trust_remote_code", "--qformat", "nvfp4_experts_only",
            "--calib_size", "2", "--calib_seq", "16", "--no_progress"]
    assert hf_ptq.main([*argv, "--export_path", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert f"modelopt-k3-check {tmp_path / 'a'}" in out
    assert all(f"  {e}" in out for e in ("vllm", "sglang", "trtllm"))


# ----------------------------------------------------------------------------- the contract with a real export


@pytest.mark.parametrize("qformat", ["nvfp4", "nvfp4_experts_only"])
def test_hf_ptq_presets_are_served_by_vllm_and_sglang(tiny_wide_ckpt: Path, tmp_path: Path, qformat: str):
    """The acceptance criterion of issue 13 on a real hf_ptq export: the default presets pass the check.

    Needs the exporter side of issue 13 (shared fused-group scales, ModelOpt's exclude_modules
    wildcards); it fails on an exporter that writes per-piece scales or exact-name excludes.
    """
    out = tmp_path / qformat
    rc = hf_ptq.main(["--pyt_ckpt_path", str(tiny_wide_ckpt), "--trust_remote_code", "--qformat", qformat,
                      "--calib_size", "4", "--calib_seq", "32", "--no_progress", "--export_path", str(out),
                      "--target_engines", "vllm,sglang"])
    assert rc == 0
    report = check_export(out, ("vllm", "sglang"))
    assert report.ok, report.table()
