"""Nemotron-H (latent MoE, Mamba-2 / attention / MoE layers, MTP block) on transformers' own classes: the loaded
model is transformers' model bit for bit; the NVFP4 export's expert scales are what transformers' own forward
routes to each expert; the MTP block is carried as stored; the engines' rules read the export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _exports import read_export
from safetensors import safe_open

from .conftest import calibration_ids

NVFP4_RANGE = 6.0 * 448.0


def _transformers_model(ckpt: Path, dtype: torch.dtype, experts: str = "eager"):
    from transformers import NemotronHForCausalLM

    model = NemotronHForCausalLM.from_pretrained(ckpt, dtype=dtype)
    model.config._experts_implementation = experts
    return model.eval()


def _source(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[key] = f.get_tensor(key)
    return out


def test_loaded_model_is_transformers_own_model_bit_for_bit(nemotron_h_ckpt: Path):
    """bf16: logits equal transformers' (eager and grouped_mm experts: ours run relu2 through the gate hook);
    fp32 within 1e-5; the module names are the hub checkpoint's (``backbone.``), the experts ours."""
    from modelopt_k3 import load_pretrained
    from modelopt_k3.models.nemotron_h import NemotronHFusedExperts

    ids = calibration_ids()
    ours = load_pretrained(nemotron_h_ckpt, progress=False, dtype=torch.bfloat16)
    names = set(ours.state_dict())
    assert {k for k in _source(nemotron_h_ckpt) if not k.startswith("mtp.")} - names == {
        f"backbone.layers.{i}.mixer.experts.{e}.{p}.weight" for i in (1, 3) for e in range(8)
        for p in ("up_proj", "down_proj")}
    experts = ours.backbone.layers[1].mixer.experts
    assert isinstance(experts, NemotronHFusedExperts) and experts.gate_up_proj.shape == (8, 32, 48)
    theirs = _transformers_model(nemotron_h_ckpt, torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)
        for model in (ours, theirs):
            model.config._experts_implementation = "grouped_mm"
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)
    ours32 = load_pretrained(nemotron_h_ckpt, progress=False, dtype=torch.float32)
    theirs32 = _transformers_model(nemotron_h_ckpt, torch.float32)
    with torch.no_grad():
        diff = (ours32(input_ids=ids).logits - theirs32(input_ids=ids).logits).abs().max()
    assert diff <= 1e-5, diff


def _routed_inputs(ckpt: Path) -> dict[str, dict[int, torch.Tensor]]:
    """Experts module (checkpoint name) -> expert -> the latent rows transformers' own forward routes to it on
    the calibration ids (``NemotronHExperts`` inputs, recorded by a pre-hook)."""
    model = _transformers_model(ckpt, torch.bfloat16)
    seen: dict[str, dict[int, torch.Tensor]] = {}

    def record(name):
        def hook(module, args):
            hidden, index = args[0], args[1]
            seen[name] = {e: hidden[(index == e).any(-1)] for e in range(module.num_experts)}
        return hook

    for name, module in model.named_modules():
        if type(module).__name__ == "NemotronHExperts":
            module.register_forward_pre_hook(record("backbone." + name.removeprefix("model.")))
    with torch.no_grad():
        model(input_ids=calibration_ids())
    return seen


@pytest.mark.slow
def test_expert_scales_are_transformers_routed_amaxes_and_the_rest_is_as_stored(nemotron_h_ckpt, nemotron_h_export):
    """Each MoE layer's up_proj input_scale is the amax of the latent rows transformers routes to any of its
    experts / (6 * 448), its down_proj input_scale the amax of relu2(up) over them (the gate hook; one input scale
    per layer and GEMM, as the engines read it), each weight_scale_2 the weight's amax / (6 * 448); everything
    outside the routed experts (Mamba, attention, router, latent projections, shared experts, MTP) is the source's
    bytes, and the exclusions name the MTP block."""
    src, out = _source(nemotron_h_ckpt), read_export(nemotron_h_export)
    routed = _routed_inputs(nemotron_h_ckpt)
    assert sorted(routed) == ["backbone.layers.1.mixer.experts", "backbone.layers.3.mixer.experts"]
    for module, per_expert in routed.items():
        assert all(len(x) for x in per_expert.values()), module  # every expert calibrated
        up_in = max(x.abs().max() for x in per_expert.values())
        down_in = max(torch.relu(torch.nn.functional.linear(x, src[f"{module}.{e}.up_proj.weight"])).square().max()
                      for e, x in per_expert.items())
        for e in per_expert:
            for proj, amax_in in (("up_proj", up_in), ("down_proj", down_in)):
                p, w = f"{module}.{e}.{proj}", src[f"{module}.{e}.{proj}.weight"]
                assert out[f"{p}.weight"].shape == (w.shape[0], w.shape[1] // 2), p
                for key, amax in (("input_scale", amax_in), ("weight_scale_2", w.abs().max())):
                    assert torch.equal(out[f"{p}.{key}"].reshape(()), amax.float() / NVFP4_RANGE), (p, key)
    kept = {k for k in src if ".mixer.experts." not in k or k.startswith("mtp.")}
    assert kept <= set(out)
    for key in kept:
        assert out[key].dtype == src[key].dtype and torch.equal(out[key], src[key]), key
    assert out["backbone.layers.1.mixer.gate.e_score_correction_bias"].dtype == torch.float32
    quant = json.loads((nemotron_h_export / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "NVFP4" and "mtp*" in quant["exclude_modules"]


@pytest.mark.slow
def test_engines_load_the_export_and_refuse_it_with_a_bf16_module_not_excluded(nemotron_h_export, tmp_path: Path):
    """vLLM loads it (its mapper reads the ``backbone.`` exclusions as ``model.``); SGLang refuses the stand-in's 2
    Mamba groups (it builds ``mamba_n_groups``, default 8: observed, tests/data/engine_conformance.json) and loads
    it once config.json says ``mamba_n_groups`` 2; TensorRT-LLM is not verified, so never "loads"; with the shared
    experts dropped from the exclusions both engines build them NVFP4 while they are stored BF16, and refuse."""
    from modelopt_k3.check import check_export
    from modelopt_k3.check.report import LOADS, NOT_VERIFIED, REFUSES

    report = check_export(nemotron_h_export, ("vllm", "sglang", "trtllm"), block_scales=False)
    verdicts = report.results
    assert verdicts["vllm"].verdict == LOADS and verdicts["sglang"].verdict == REFUSES
    assert "mamba_n_groups" in verdicts["sglang"].refusals[0].reason
    assert verdicts["trtllm"].verdict == NOT_VERIFIED and "not verified" in verdicts["trtllm"].refusals[0].reason
    groups = tmp_path / "groups"
    shutil.copytree(nemotron_h_export, groups)
    cfg = json.loads((groups / "config.json").read_text())
    (groups / "config.json").write_text(json.dumps({**cfg, "mamba_n_groups": cfg["n_groups"]}))
    assert check_export(groups, ("sglang",), block_scales=False).results["sglang"].verdict == LOADS
    broken = tmp_path / "broken"
    shutil.copytree(nemotron_h_export, broken)
    shared = "backbone.layers.1.mixer.shared_experts*"
    for name, path in (("hf_quant_config.json", ("quantization", "exclude_modules")),
                       ("config.json", ("quantization_config", "ignore"))):
        cfg = json.loads((broken / name).read_text())
        cfg[path[0]][path[1]].remove(shared)
        (broken / name).write_text(json.dumps(cfg))
    report = check_export(broken, ("vllm", "sglang"), block_scales=False)
    for r in report.results.values():
        assert r.verdict != LOADS, r.engine
        assert any(f.tensor.startswith("backbone.layers.1.mixer.shared_experts.") for f in r.refusals), r.refusals


GOLDEN = json.loads((Path(__file__).parents[2] / "data" / "modelopt_0_47_nemotron_h_golden.json").read_text())


def _sha(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.slow
def test_export_equals_modelopt_0_47_bit_for_bit(nemotron_h_ckpt, nemotron_h_export):
    """nvidia-modelopt 0.47's NVFP4_EXPERTS_ONLY_CFG export of the same stand-in (scripts/modelopt_golden_nemotron_h.py):
    every tensor byte for byte (codes, block scales, weight_scale_2, input_scale), but the routers by value (ModelOpt
    writes them upcast to FP32; we keep the stored BF16) and the MTP block, which ModelOpt drops (transformers never
    loads it) and we carry. Not compared: ModelOpt's exclude_modules, which 0.47 under transformers 5.25 writes
    with a ``\\x00backbone.pt_name_sentinel`` inside every name (no engine matches those)."""
    ours, golden = read_export(nemotron_h_export), GOLDEN["tensors"]
    assert {k for k in ours if not k.startswith("mtp.")} == set(golden)
    routers = {k for k in golden if k.endswith(".mixer.gate.weight")}
    assert routers and all(golden[k]["dtype"] == "float32" for k in routers)
    src = _source(nemotron_h_ckpt)
    for key, want in golden.items():
        got = ours[key]
        assert list(got.shape) == want["shape"], key
        if key in routers:  # BF16 as stored; ModelOpt's FP32 copy holds the same values
            assert got.dtype == torch.bfloat16 and torch.equal(got, src[key]), key
            continue
        assert str(got.dtype).removeprefix("torch.") == want["dtype"] and _sha(got) == want["sha256"], key
    assert GOLDEN["hf_quant_config"]["quantization"]["quant_algo"] == "NVFP4"


@pytest.mark.slow
def test_source_check_refuses_a_layer_count_off_the_pattern_and_a_missing_mtp_tensor(nemotron_h_ckpt, tmp_path):
    """transformers silently takes the layer kinds from hybrid_override_pattern; a num_hidden_layers that disagrees
    is refused by name, and so is an MTP block missing a tensor its pattern needs (before any weight is read)."""
    from safetensors.torch import save_file

    from modelopt_k3 import load_pretrained
    from modelopt_k3.checkpoint.source_check import SourceMismatchError
    from modelopt_k3.spec import SpecError

    bad_config = tmp_path / "layers"
    shutil.copytree(nemotron_h_ckpt, bad_config)
    cfg = json.loads((bad_config / "config.json").read_text())
    (bad_config / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 5}))
    with pytest.raises(SpecError, match="num_hidden_layers = 5 but hybrid_override_pattern has 4 layers"):
        load_pretrained(bad_config, progress=False)

    no_mtp_norm = tmp_path / "mtp"
    no_mtp_norm.mkdir()
    for f in nemotron_h_ckpt.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, no_mtp_norm / f.name)
    tensors = {k: v for k, v in _source(nemotron_h_ckpt).items() if k != "mtp.layers.1.final_layernorm.weight"}
    index = json.loads((nemotron_h_ckpt / "model.safetensors.index.json").read_text())
    save_file(tensors, no_mtp_norm / "model.safetensors")
    index["weight_map"] = dict.fromkeys(tensors, "model.safetensors")
    (no_mtp_norm / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SourceMismatchError, match=r"mtp\.layers\.1\.final_layernorm\.weight"):
        load_pretrained(no_mtp_norm, progress=False)
