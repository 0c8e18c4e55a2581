"""Qwen3.5-MoE (the VLM as released) through the generic transformers-native spec: the checkpoint view of its
fused experts, the load against transformers' own model, the export (vision tower and MTP block as stored), the
layerwise path, the command line and the engine checks."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from _exports import read_export
from safetensors.torch import save_file

from modelopt_k3.checkpoint import CheckpointError, CheckpointReader
from modelopt_k3.testing.qwen3_5_moe import calibration_token_ids
from modelopt_k3.testing.reference import read_checkpoint

RECIPE = "models/Qwen/Qwen3.5-MoE/nvfp4"
LAYER0 = "model.language_model.layers.0.mlp.experts"


def test_the_view_gives_each_expert_its_own_byte_range_of_the_fused_tensors(tmp_path):
    """The fast test: ``make_tiny`` through the registry; the view names every expert's gate/up/down as the rows of
    the stored ``[E, 2I, H]`` / ``[E, H, I]`` tensors (gate rows first), reads only those bytes, and refuses a
    planted per-expert tensor beside the fused one."""
    from modelopt_k3.testing import make_tiny

    ckpt = make_tiny("qwen3_5_moe", tmp_path / "ckpt", text={"num_hidden_layers": 1, "full_attention_interval": 1,
                                                            "mtp_num_hidden_layers": 0})
    stored = read_checkpoint(ckpt)
    gate_up, down = stored[f"{LAYER0}.gate_up_proj"], stored[f"{LAYER0}.down_proj"]
    inter = gate_up.shape[1] // 2
    with CheckpointReader(ckpt) as reader:
        names = set(reader.names())
        assert f"{LAYER0}.gate_up_proj" not in names and f"{LAYER0}.down_proj" not in names
        for e in range(gate_up.shape[0]):
            assert torch.equal(reader.get(f"{LAYER0}.{e}.gate_proj.weight"), gate_up[e, :inter])
            assert torch.equal(reader.get(f"{LAYER0}.{e}.up_proj.weight"), gate_up[e, inter:])
            assert torch.equal(reader.get(f"{LAYER0}.{e}.down_proj.weight"), down[e])
        assert reader.log.bytes == gate_up.numel() * 2 + down.numel() * 2  # each expert's bytes, once
        assert reader.stored_name(f"{LAYER0}.3.up_proj.weight") == f"{LAYER0}.gate_up_proj"
    from modelopt_k3.checkpoint.source_check import check_experts
    from modelopt_k3.spec import get_spec

    config = json.loads((ckpt / "config.json").read_text())
    wrong = {**config, "text_config": {**config["text_config"], "num_experts": 16}}
    with CheckpointReader(ckpt) as reader, pytest.raises(CheckpointError, match="num_experts=16"):
        check_experts(reader.headers(), wrong, get_spec("qwen3_5_moe"), reader.stored_name)  # the VLM on meta
    planted = {f"{LAYER0}.0.gate_proj.weight": gate_up[0, :inter].clone()}
    save_file(planted, str(ckpt / "planted.safetensors"))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(planted, "planted.safetensors"))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="whose experts are stored fused"):
        CheckpointReader(ckpt)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_equal_transformers_own_model(qwen3_5_moe_ckpt, dtype):
    """Our load (view -> per-expert merge, fused experts re-classed, eager) against transformers'
    ``Qwen3_5MoeForConditionalGeneration.from_pretrained``: bf16 bit for bit; fp32 within 1e-5 (also equal)."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    import modelopt_k3

    ids = calibration_token_ids()
    model = modelopt_k3.load_pretrained(qwen3_5_moe_ckpt, progress=False, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}  # the text and vision sub-models too
    assert len(model.modelopt_k3.spec.experts_modules(model)) == 4
    ref = Qwen3_5MoeForConditionalGeneration.from_pretrained(qwen3_5_moe_ckpt, dtype=dtype,
                                                             experts_implementation="eager")
    with torch.no_grad():
        ours, theirs = model(input_ids=ids).logits, ref(input_ids=ids).logits
    if dtype == torch.bfloat16:
        assert torch.equal(ours, theirs)
    else:
        assert (ours - theirs).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_export_keeps_vision_and_mtp_as_stored_and_quantizes_only_routed_experts(qwen3_5_moe_ckpt,
                                                                                qwen3_5_moe_export):
    src, out = read_checkpoint(qwen3_5_moe_ckpt), read_export(qwen3_5_moe_export)
    kept = [k for k in src if k.startswith(("model.visual.", "mtp."))]
    assert kept and all(out[k].dtype == src[k].dtype and torch.equal(out[k], src[k]) for k in kept)
    quantized = {k.rpartition(".")[0] for k in out if k.endswith(".weight_scale")}
    assert quantized and all(".mlp.experts." in k and not k.startswith("mtp.") for k in quantized)
    assert len(quantized) == 4 * 8 * 3  # every routed expert's gate/up/down of every layer
    for e in range(8):  # gate and up share one global scale and one input scale (every engine's w13)
        for part in ("weight_scale_2", "input_scale"):
            assert torch.equal(out[f"{LAYER0}.{e}.gate_proj.{part}"], out[f"{LAYER0}.{e}.up_proj.{part}"])
    dense = [k for k in src if k.startswith("model.language_model.") and ".mlp.experts." not in k]
    assert all(torch.equal(out[k], src[k]) for k in dense)  # GDN, attention, shared expert, routers, norms
    hf = json.loads((qwen3_5_moe_export / "hf_quant_config.json").read_text())["quantization"]
    assert hf["quant_algo"] == "NVFP4"
    for entry in ("lm_head", "model.visual*", "mtp*", "model.language_model.layers.0.linear_attn*",
                  "model.language_model.layers.3.self_attn*", "model.language_model.layers.0.mlp.shared_expert*",
                  "model.language_model.layers.0.mlp.shared_expert_gate", "model.language_model.layers.0.mlp.gate"):
        assert entry in hf["exclude_modules"], entry
    config = json.loads((qwen3_5_moe_export / "config.json").read_text())
    assert config["text_config"]["dtype"] == "bfloat16" and "vision_config" in config


@pytest.mark.slow
def test_export_equals_modelopt_0_47(qwen3_5_moe_export):
    """Every tensor nvidia-modelopt 0.47.0 exports for the same stand-in (NVFP4_EXPERTS_ONLY_CFG, the same
    calibration ids; scripts/modelopt_golden_qwen3_5_moe.py) equals ours bit for bit, input scales included; ours
    adds only the MTP block ModelOpt drops, and its exclusions are ModelOpt's plus ``mtp*``."""
    golden = json.loads((Path(__file__).parents[2] / "data" / "modelopt_0_47_qwen3_5_moe_golden.json").read_text())
    ours = read_export(qwen3_5_moe_export)
    assert {k for k in ours if not k.startswith("mtp.")} == set(golden["tensors"])
    for key, want in golden["tensors"].items():
        t = ours[key]
        got = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
               "sha256": hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()}
        if "value" in want:
            got["value"] = t.float().item().hex()
        assert got == want, key
    hf = json.loads((qwen3_5_moe_export / "hf_quant_config.json").read_text())["quantization"]
    theirs = golden["hf_quant_config"]["quantization"]
    assert {**hf, "exclude_modules": [e for e in hf["exclude_modules"] if e != "mtp*"]} == theirs


@pytest.mark.slow
def test_engine_checks(qwen3_5_moe_export):
    """vLLM's rules load the export as written (its routers unquantized, the vision tower excluded by name, the
    zero-centered norms' 1 + weight in the scale bound: no implausible-scale warning); SGLang's serve different
    numbers for the stand-in's vision config (no deepstack_visual_indexes: SGLang builds three mergers no tensor
    fills, as its own loader did) and nothing else; TensorRT-LLM is "not verified"."""
    from modelopt_k3.check import check_export
    from modelopt_k3.check.report import DIFFERENT, NOT_VERIFIED

    report = check_export(qwen3_5_moe_export, ("vllm", "sglang", "trtllm"))
    assert report.results["vllm"].ok and not report.results["vllm"].warnings, report.table()
    sglang = report.results["sglang"]
    assert sglang.verdict == DIFFERENT and [d.module for d in sglang.deviations] == ["visual.deepstack_merger_list"]
    assert report.results["trtllm"].verdict == NOT_VERIFIED


@pytest.mark.slow
def test_layerwise_export_equals_resident_and_hf_ptq_runs(qwen3_5_moe_ckpt, tmp_path):
    from modelopt_k3.cli import hf_ptq

    flags = ["--pyt_ckpt_path", str(qwen3_5_moe_ckpt), "--qformat", "nvfp4", "--calib_size", "4", "--batch_size",
             "2", "--calib_seq", "24", "--no_progress", "--target_engines", "vllm"]
    for where, extra in (("resident", ["--report", "none"]), ("layerwise", ["--layerwise"])):
        assert hf_ptq.run(hf_ptq.build_parser().parse_args([*flags, "--export_path", str(tmp_path / where),
                                                            *extra])) == 0
    a, b = read_export(tmp_path / "resident"), read_export(tmp_path / "layerwise")
    assert set(a) == set(b)
    assert [k for k in a if not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))] == []
    hf = json.loads((tmp_path / "resident" / "hf_quant_config.json").read_text())
    assert hf["modelopt_k3"]["recipe"] == RECIPE  # --qformat nvfp4 resolves to the model's own recipe


@pytest.mark.slow
def test_every_text_linear_nvfp4_shares_the_scales_the_engines_fuse(qwen3_5_moe_ckpt, tmp_path):
    """A recipe quantizing every text Linear: the probe (this model's tiny VLM) groups what reads one input --
    the gated delta net's in_proj_qkv/z/b/a, q/k/v, the shared expert's gate/up (its Linear-built gate a member,
    kept BF16) -- and the export shares their scales, so vLLM's in_proj_qkvz/in_proj_ba/qkv_proj/gate_up_proj
    load it as calibrated; the preflight refuses activations the text calibration never reaches (vision)."""
    from modelopt_k3.check import check_export
    from modelopt_k3.cli import hf_ptq
    from modelopt_k3.run.preflight import PreflightError

    recipe = tmp_path / "all.yaml"
    recipe.write_text("description: every text Linear NVFP4\nalgorithm: max\nkv_cache: null\n"
                      "calibrate_all_experts: false\nquant_cfg:\n  - pattern: '*'\n    weights: nvfp4\n"
                      "    inputs: nvfp4\n  - pattern: 'model.visual.*'\n    enable: false\n    reason: vision\n"
                      "  - import: units/default_disabled\n")
    flags = ["--pyt_ckpt_path", str(qwen3_5_moe_ckpt), "--calib_size", "4", "--batch_size", "2", "--calib_seq", "24",
             "--no_progress", "--report", "none", "--target_engines", "vllm"]
    with pytest.raises(PreflightError, match="text calibration never runs"):
        hf_ptq.run(hf_ptq.build_parser().parse_args([*flags, "--recipe", "presets/nvfp4_default", "--export_path",
                                                     str(tmp_path / "refused")]))
    out = tmp_path / "all"
    assert hf_ptq.run(hf_ptq.build_parser().parse_args([*flags, "--recipe", str(recipe), "--export_path",
                                                        str(out)])) == 0
    t = read_export(out)
    layer0, layer3 = "model.language_model.layers.0.", "model.language_model.layers.3."
    groups = [[f"{layer0}linear_attn.{p}" for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")],
              [f"{layer3}self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")],
              [f"{layer0}mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj")]]
    for members in groups:
        for part in ("weight_scale_2", "input_scale"):
            assert len({t[f"{m}.{part}"].item() for m in members}) == 1, (members, part)
    assert t[f"{layer0}mlp.shared_expert_gate.weight"].dtype == torch.bfloat16
    assert check_export(out, ("vllm",)).results["vllm"].ok


@pytest.mark.slow
def test_converter_weight_only_equals_the_model_path(qwen3_5_moe_ckpt, tmp_path):
    """modelopt-k3-convert (shard by shard, through the same view; no model built) with a weight-only recipe writes
    what hf_ptq --qformat w4a16_nvfp4 writes, byte for byte; without --recipe it refuses, naming why."""
    from modelopt_k3.cli import hf_ptq
    from modelopt_k3.convert import convert_checkpoint
    from modelopt_k3.spec import SpecError, get_spec

    convert_checkpoint(qwen3_5_moe_ckpt, tmp_path / "conv", "presets/w4a16_nvfp4")
    assert hf_ptq.run(hf_ptq.build_parser().parse_args([
        "--pyt_ckpt_path", str(qwen3_5_moe_ckpt), "--qformat", "w4a16_nvfp4", "--calib_size", "4", "--batch_size", "2",
        "--calib_seq", "24", "--no_progress", "--report", "none", "--target_engines", "vllm",
        "--export_path", str(tmp_path / "model")])) == 0
    a, b = read_export(tmp_path / "conv"), read_export(tmp_path / "model")
    assert set(a) == set(b)
    assert [k for k in a if not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))] == []
    with pytest.raises(SpecError, match="input scales need calibration"):
        get_spec("qwen3_5_moe").converter_recipe()


@pytest.mark.slow
def test_already_quantized_and_malformed_configs_are_refused(qwen3_5_moe_ckpt, tmp_path):
    import shutil

    import modelopt_k3
    from modelopt_k3.spec import SpecError

    ckpt = tmp_path / "q"
    shutil.copytree(qwen3_5_moe_ckpt, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "text_config": {**config["text_config"],
                                                                           "layer_types": ["full_attention"]}}))
    with pytest.raises(SpecError, match="layer_types"):
        modelopt_k3.load_pretrained(ckpt, progress=False)
    (ckpt / "config.json").write_text(json.dumps({**config, "text_config": {**config["text_config"],
                                                                           "num_experts": 16}}))
    with pytest.raises(Exception, match=r"config.json needs \[16, 64\]"):  # the carried MTP layer's router
        modelopt_k3.load_pretrained(ckpt, progress=False)
    (ckpt / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(SpecError, match="already quantized"):
        modelopt_k3.load_pretrained(ckpt, progress=False)


@pytest.mark.slow
def test_the_planned_activations_bound_the_stand_ins_forward(qwen3_5_moe_ckpt):
    """``memory.py`` against the live tensors of the stand-in's own forward (the measure of
    tests/memory/test_activation_models.py): an upper bound at a MoE-dominated and an attention-dominated shape."""
    from memory._live import LiveTensors
    from memory.test_activation_models import _planned_forward

    import modelopt_k3

    net = modelopt_k3.load_pretrained(qwen3_5_moe_ckpt, progress=False, dtype=torch.bfloat16)
    ratios = []
    for batch, seq in ((2, 64), (1, 512)):
        ids = torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(0))
        live = LiveTensors()
        with torch.no_grad(), live.mode:
            net(input_ids=ids)
        ratios.append(_planned_forward(Path(qwen3_5_moe_ckpt), batch, seq) / live.peak)
    assert all(1.0 <= r <= 1.6 for r in ratios), ratios


@pytest.mark.slow
def test_full_size_397b_plan_fits_8_gpus_expert_parallel(tmp_path):
    """The planner on a header-only Qwen3.5-397B-A17B layout (60 layers x 512 experts, the vision tower, MTP;
    sparse shards): calibrated NVFP4 at 4 x 2048 tokens fits 8 x 141 GiB expert-parallel (about 0.8 TB of BF16),
    never one GPU; the fused experts are counted per expert through the view."""
    import modelopt_k3
    from modelopt_k3.testing.qwen3_5_moe import make_qwen3_5_moe_layout

    report = modelopt_k3.plan_memory(make_qwen3_5_moe_layout(tmp_path / "l397"), world_size=8, gpu_mem_gib=141)
    assert report.smallest[("expert_parallel", "fsdp2", "bf16")] == 8
    assert report.smallest[("whole", "replicated", "bf16")] is None
    groups = [g for g in report.layout.experts if g.module.startswith("model.language_model.")]
    assert len(groups) == 60 and all(g.num_experts == 512 for g in groups)
