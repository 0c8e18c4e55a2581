"""Qwen3-MoE through the spec contract: layout rules, the fused forward against transformers and an unfused
reference, the export against ModelOpt 0.47's own (golden), hf_ptq end to end, the engine checks."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from modelopt_k3.models.common.experts import combine_in_expert_order
from modelopt_k3.spec import get_spec
from modelopt_k3.testing.qwen3_moe import (
    QWEN3_MOE_TINY_DEFAULTS,
    calibration_token_ids,
    checkpoint_config,
    raised_gate_up_expert,
)

GOLDEN = json.loads((Path(__file__).parents[2] / "data" / "modelopt_0_47_qwen3_moe_golden.json").read_text())


def _sparse_layers_built_by_transformers(**cfg) -> list[int]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = {k: v for k, v in checkpoint_config({**QWEN3_MOE_TINY_DEFAULTS, **cfg}).items()
              if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config))
    return [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)]


@pytest.mark.parametrize("cfg", [{}, {"mlp_only_layers": []}, {"num_hidden_layers": 4, "decoder_sparse_step": 2},
                                 {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}])
def test_moe_layers_follow_transformers(cfg):
    """The source check's experts are the MoE layers transformers' Qwen3MoeDecoderLayer builds, which are the ones
    its documented rule places (a sparse block at i iff i not in mlp_only_layers and (i + 1) % step == 0)."""
    config = checkpoint_config({**QWEN3_MOE_TINY_DEFAULTS, **cfg})
    rule = [i for i in range(config["num_hidden_layers"])
            if i not in (config.get("mlp_only_layers") or []) and (i + 1) % config["decoder_sparse_step"] == 0]
    assert rule == _sparse_layers_built_by_transformers(**cfg)
    layouts = get_spec("qwen3_moe").source_check.expert_layout(config)
    assert [layout.module for layout in layouts] == [f"model.layers.{i}.mlp.experts" for i in rule]
    inter, hidden = config["moe_intermediate_size"], config["hidden_size"]
    assert {(x.num_experts, tuple(sorted(x.projections.items()))) for x in layouts} <= {(config["num_experts"], (
        ("down_proj", (hidden, inter)), ("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden))))}


@pytest.mark.parametrize("only", [[1, "2"], [True], "1", [1.0]], ids=["a-string", "a-bool", "not-a-list", "a-float"])
def test_mlp_only_layers_must_be_a_list_of_layer_indices(only):
    """One bad entry refuses the config (every entry is checked, not just one of them)."""
    from modelopt_k3.models.qwen3_moe.source_layout import check_config_fields
    from modelopt_k3.spec import SpecError

    config = checkpoint_config(QWEN3_MOE_TINY_DEFAULTS)
    check_config_fields({**config, "mlp_only_layers": [0, 1]})
    with pytest.raises(SpecError, match=r"mlp_only_layers = .*; a list of layer indices is needed"):
        check_config_fields({**config, "mlp_only_layers": only})


def test_dense_layout_matches_the_checkpoint(qwen3_moe_ckpt):
    from modelopt_k3.checkpoint import CheckpointReader

    config = json.loads((qwen3_moe_ckpt / "config.json").read_text())
    rules = [(re.compile(rx), shape) for rx, shape, _ in get_spec("qwen3_moe").source_check.dense_layout(config)]
    with CheckpointReader(qwen3_moe_ckpt) as reader:
        for key, (_, shape) in reader.inventory().items():
            if ".mlp.experts." in key:
                continue
            fixed = [want for rx, want in rules if want is not None and rx.fullmatch(key)]
            assert fixed, f"no dense rule for {key}"
            assert tuple(shape) == fixed[0], key


def test_combine_is_transformers_index_add_order():
    """Bare outputs combined as transformers' eager forward does (weight, round, index_add per expert in order)."""
    g = torch.Generator().manual_seed(0)
    n, k, h, e = 64, 3, 16, 8
    per_slot = torch.randn(n, k, h, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g).bfloat16()
    want = torch.zeros(n, h, dtype=torch.bfloat16)
    for expert in range(e):
        token, slot = torch.where(ids == expert)
        want.index_add_(0, token, (per_slot[token, slot] * weights[token, slot, None]).to(want.dtype))
    got = combine_in_expert_order(per_slot, ids, weights, torch.bfloat16)
    assert torch.equal(got, want)
    assert not torch.equal(got, (per_slot.float() * weights.float().unsqueeze(-1)).sum(1).bfloat16())


def _unfused_reference_logits(ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' model with every MoE block's experts replaced by per-expert Qwen3MoeMLP modules filled
    straight from the checkpoint's per-expert keys (separate gate/up matmuls), summed in index_add order."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP, Qwen3MoeSparseMoeBlock

    from modelopt_k3.testing.reference import read_checkpoint

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    stored = read_checkpoint(ckpt)
    cfg = model.config
    for name, block in model.named_modules():
        if not isinstance(block, Qwen3MoeSparseMoeBlock):
            continue
        mlps = []
        for e in range(cfg.num_experts):
            mlp = Qwen3MoeMLP(cfg, intermediate_size=cfg.moe_intermediate_size).bfloat16()
            for proj in ("gate_proj", "up_proj", "down_proj"):
                getattr(mlp, proj).weight.data.copy_(stored[f"{name}.experts.{e}.{proj}.weight"])
            mlps.append(mlp)

        def forward(hidden, top_k_index, top_k_weights, mlps=mlps):
            out = torch.zeros_like(hidden)
            for e, mlp in enumerate(mlps):
                token, slot = torch.where(top_k_index == e)
                if len(token):
                    out.index_add_(0, token, (mlp(hidden[token]) * top_k_weights[token, slot, None]).to(out.dtype))
            return out

        block.experts.forward = forward
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.slow
def test_fused_logits_equal_transformers_and_the_unfused_reference(qwen3_moe_ckpt):
    """Our load (fused experts re-classed on the instance, eager) gives transformers' own logits and the
    unfused per-expert reference's, bit for bit; transformers' class itself is left unpatched."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    import modelopt_k3

    ids = calibration_token_ids()
    model = modelopt_k3.load_pretrained(qwen3_moe_ckpt, progress=False)
    experts = model.modelopt_k3.spec.experts_modules(model)
    assert len(experts) == 2 and all(isinstance(m, Qwen3MoeExperts) for m in experts.values())
    assert "forward" in Qwen3MoeExperts.__dict__ and not hasattr(Qwen3MoeExperts, "down_input_hook")
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    ref = AutoModelForCausalLM.from_pretrained(qwen3_moe_ckpt, dtype=torch.bfloat16, experts_implementation="eager")
    with torch.no_grad():
        theirs = ref(input_ids=ids).logits
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, _unfused_reference_logits(qwen3_moe_ckpt, ids))


def _tensors(export: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(export.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[key] = f.get_tensor(key)
    return out


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.slow
def test_export_equals_modelopt_0_47(qwen3_moe_export):
    """Every tensor of our calibrated NVFP4 export equals nvidia-modelopt 0.47.0's export of the same tiny model
    on the same calibration ids, bit for bit (input_scale included: both run transformers' eager numerics),
    and so do hf_quant_config.json's quantization and config.json's quantization_config (tests/data README)."""
    golden = GOLDEN["tensors"]
    ours = _tensors(qwen3_moe_export)
    assert set(ours) == set(golden)
    for key, want in golden.items():
        t = ours[key]
        got = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": _sha(t)}
        if "value" in want:
            got["value"] = t.float().item().hex()
        assert got == want, key
    hf_quant = json.loads((qwen3_moe_export / "hf_quant_config.json").read_text())
    assert hf_quant["producer"] == GOLDEN["hf_quant_config"]["producer"]
    assert hf_quant["quantization"] == GOLDEN["hf_quant_config"]["quantization"]
    config = json.loads((qwen3_moe_export / "config.json").read_text())
    assert config["quantization_config"] == GOLDEN["config_quantization_config"]


@pytest.mark.slow
def test_gate_up_share_weight_scale_2_from_both_halves(qwen3_moe_ckpt, qwen3_moe_export):
    """w1/w3 of an expert share weight_scale_2 = max over gate and up; the stand-in puts the max in up_proj of
    one expert and in gate_proj of another, so a scale taken from either half alone is caught."""
    from modelopt_k3.testing.reference import read_checkpoint

    stored, out = read_checkpoint(qwen3_moe_ckpt), _tensors(qwen3_moe_export)
    for layer in (0, 2):
        for proj, expert in raised_gate_up_expert(layer, 8).items():
            head = f"model.layers.{layer}.mlp.experts.{expert}"
            other = "gate_proj" if proj == "up_proj" else "up_proj"
            amax = stored[f"{head}.{proj}.weight"].float().abs().max()
            assert stored[f"{head}.{other}.weight"].float().abs().max() < amax
            for p in ("gate_proj", "up_proj"):
                assert out[f"{head}.{p}.weight_scale_2"].item() == (amax / (6.0 * 448.0)).item()


def _edit_export(src: Path, dst: Path, drop_exclude: str) -> Path:
    import shutil

    shutil.copytree(src, dst)
    for name, key in (("hf_quant_config.json", ("quantization", "exclude_modules")),
                      ("config.json", ("quantization_config", "ignore"))):
        cfg = json.loads((dst / name).read_text())
        cfg[key[0]][key[1]].remove(drop_exclude)
        (dst / name).write_text(json.dumps(cfg))
    return dst


@pytest.mark.slow
def test_engine_checks(qwen3_moe_export, tmp_path):
    """vLLM loads the export as written; SGLang refuses the 64-wide stand-in (flashinfer_trtllm's w2 rows % 128)
    and would skip its dense layer (tests/models/qwen3_moe/test_sglang.py). Without the router in the exclusions
    vLLM (router built with the quant config) refuses its missing NVFP4 scales while SGLang (router built
    unquantized) raises nothing about it."""
    from modelopt_k3.check import check_export

    report = check_export(qwen3_moe_export, ("vllm", "sglang", "trtllm"))
    assert report.results["vllm"].ok, report.table()
    sglang = report.results["sglang"]
    assert sglang.verdict == "refuses" and all("GEMM2 (w2) 64" in r.reason for r in sglang.refusals), report.table()
    assert {d.module for d in sglang.deviations} == {"model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.down_proj"}
    # TensorRT-LLM builds every layer's mlp as a MoE: the stand-in's mlp_only_layers=[1] layer has no module.
    trt = report.results["trtllm"].refusals
    assert trt and all(r.tensor.startswith("model.layers.1.mlp.") for r in trt), report.table()
    assert "every layer's mlp as Qwen3MoE" in trt[0].reason
    edited = _edit_export(qwen3_moe_export, tmp_path / "router_not_excluded", "model.layers.0.mlp.gate")
    report = check_export(edited, ("vllm", "sglang"))
    assert not any(".mlp.gate." in r.tensor for r in report.results["sglang"].refusals), report.table()
    refusals = report.results["vllm"].refusals
    assert refusals and all(r.tensor.startswith("model.layers.0.mlp.gate") for r in refusals), report.table()


@pytest.mark.slow
def test_hf_ptq_runs_qwen3_moe(qwen3_moe_ckpt, tmp_path):
    """examples/hf_ptq.py --pyt_ckpt_path <tiny Qwen3-MoE> end to end, engine check included."""
    import runpy
    import sys

    out = tmp_path / "export"
    argv = ["hf_ptq.py", "--pyt_ckpt_path", str(qwen3_moe_ckpt), "--recipe", "nvfp4_default", "--export_path",
            str(out), "--calib_size", "8", "--calib_seq", "32", "--batch_size", "4", "--no_progress",
            "--target_engines", "vllm", "--report", "none"]
    example = Path(__file__).parents[3] / "examples" / "hf_ptq.py"
    old, sys.argv = sys.argv, argv
    try:
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(example), run_name="__main__")
    finally:
        sys.argv = old
    assert done.value.code in (0, None)
    algos = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert algos["quant_algo"] == "NVFP4" and "model.layers.2.mlp.gate" in algos["exclude_modules"]
    assert "model.layers.2.mlp.experts.7.up_proj.weight_scale_2" in json.loads(
        (out / "model.safetensors.index.json").read_text())["weight_map"]


@pytest.mark.slow
def test_converter_equals_model_path_weight_only_and_refuses_calibrated(qwen3_moe_ckpt, tmp_path):
    """BF16 experts have no calibration-free W4A4 NVFP4 (input_scale needs activations): the converter refuses
    a calibrated recipe naming the modules, and for weight-only NVFP4 (w4a16_nvfp4; its dense group scales from
    the probe of transformers' own classes, no trust_remote_code needed) writes what the model path writes."""
    import modelopt_k3
    from modelopt_k3.recipe import RecipeError

    with pytest.raises(RecipeError, match=r"needs calibration data .*mlp\.experts\.\*\.down_proj"):
        modelopt_k3.convert_checkpoint(qwen3_moe_ckpt, tmp_path / "refused", "nvfp4_default")
    converted = tmp_path / "converted"
    modelopt_k3.convert_checkpoint(qwen3_moe_ckpt, converted, "w4a16_nvfp4")
    model = modelopt_k3.load_pretrained(qwen3_moe_ckpt, progress=False)
    modelopt_k3.quantize(model, "w4a16_nvfp4", None, verbose=False)
    exported = modelopt_k3.export_checkpoint(model, tmp_path / "exported", progress=False)
    a, b = _tensors(converted), _tensors(exported)
    assert set(a) == set(b) and any(k.endswith("experts.5.up_proj.weight_scale_2") for k in a)
    for key in a:
        assert a[key].dtype == b[key].dtype and _sha(a[key]) == _sha(b[key]), key
    for name in ("hf_quant_config.json",):
        qa, qb = (json.loads((d / name).read_text())["quantization"] for d in (converted, exported))
        assert qa == qb


def test_missing_expert_or_config_field_refused_before_weights(qwen3_moe_ckpt, tmp_path):
    """The source check names a missing per-expert tensor (with the config fields behind it) and a missing
    config field before any weight is read."""
    from conftest import copy_checkpoint

    from modelopt_k3 import load_pretrained
    from modelopt_k3.spec import SpecError

    key = "model.layers.2.mlp.experts.5.up_proj.weight"
    broken = copy_checkpoint(qwen3_moe_ckpt, tmp_path / "missing_expert", drop=[key])
    with pytest.raises(Exception, match=rf"{re.escape(key)}(.|\n)*mlp_only_layers=\[1\]"):
        load_pretrained(broken, progress=False)
    no_field = copy_checkpoint(qwen3_moe_ckpt, tmp_path / "no_field",
                               edit_config=lambda c: c.pop("moe_intermediate_size"))
    with pytest.raises(SpecError, match="moe_intermediate_size"):
        load_pretrained(no_field, progress=False)
