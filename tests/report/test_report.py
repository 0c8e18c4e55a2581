"""The quantization report of a tiny Kimi-K3 run: its numbers recomputed independently from the export and
the source, an expert starved on purpose (routing bias) under each coverage policy, and the re-render CLI."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from modelopt_k3.cli import hf_ptq
from modelopt_k3.cli import report as report_cli

pytestmark = pytest.mark.slow  # hf_ptq runs of the tiny model

MOE = "language_model.model.layers.{}.block_sparse_moe"
STARVED_LAYER, STARVED_EXPERT = 2, 5
DENSE = "language_model.model.layers.0.mlp.down_proj"
REQUANT_KEY = f"{MOE.format(1)}.experts.0.w1.weight_scale"
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
CALIB = ["--calib_size", "8", "--calib_seq", "32", "--batch_size", "2", "--no_progress"]


def _tensors(ckpt: Path, *keys: str) -> list[torch.Tensor]:
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    out = []
    for key in keys:
        with safe_open(str(ckpt / weight_map[key]), framework="pt") as f:
            out.append(f.get_tensor(key))
    return out


def _e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Element 2i in the low nibble; bit 3 of a nibble is the sign."""
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1).long()
    return E2M1[nibbles & 7] * (1 - 2 * (nibbles >> 3)).double()


def _nvfp4_dequant(weight, weight_scale, weight_scale_2) -> torch.Tensor:
    return _e2m1(weight) * weight_scale.float().double().repeat_interleave(16, dim=-1) * float(weight_scale_2)


def _mxfp4_decode(packed, scale) -> torch.Tensor:
    return _e2m1(packed) * torch.exp2(scale.double() - 127).repeat_interleave(32, dim=-1)


@pytest.fixture(scope="module")
def probe_ckpt(tiny_ckpt, tmp_path_factory) -> Path:
    """The tiny checkpoint with expert 5 of layer 2 never routed (a -1e4 selection bias) and one MXFP4
    block of layer 1 expert 0's w1 twenty binades below the rest (NVFP4 cannot carry it losslessly)."""
    from conftest import copy_checkpoint

    bias_key = f"{MOE.format(STARVED_LAYER)}.gate.e_score_correction_bias"
    bias, scale = _tensors(tiny_ckpt, bias_key, REQUANT_KEY)
    bias = bias.clone()
    bias[STARVED_EXPERT] = -1e4
    scale = scale.clone()
    scale[0, 0] = int(scale.max()) - 20
    return copy_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("probe") / "ckpt", replace={bias_key: bias, REQUANT_KEY: scale})


@pytest.fixture(scope="module")
def shared_run(probe_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("shared") / "export"
    argv = ["--pyt_ckpt_path", str(probe_ckpt), "--trust_remote_code", "--export_path", str(out), *CALIB,
            "--eval_kl", "2", "--uncovered_experts", "shared"]
    assert hf_ptq.main(argv) == 0
    return out, json.loads((out / "quant_report" / "report.json").read_text())


def test_files_are_written(shared_run):
    out, data = shared_run
    report_dir = out / "quant_report"
    assert (data["schema"], data["version"]) == ("modelopt_k3.quant_report", 2)
    assert {m["weight_algorithm"] for m in data["modules"]} == {"max"}
    assert {m["weight_algorithm"] for m in data["experts"]} == {"lossless_cast"}  # MXFP4-sourced routed experts
    assert "## Expert coverage" in (report_dir / "report.md").read_text()
    for name in ("error_by_layer.png", "expert_tokens.png", "worst_modules.png"):
        assert (report_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_dense_module_numbers_match_an_independent_computation(shared_run, probe_ckpt):
    """rel. RMS and max error of the dequantized export vs the source weight, and its scales, from the files."""
    out, data = shared_run
    row = next(m for m in data["modules"] if m["name"] == DENSE)
    (source,) = _tensors(probe_ckpt, f"{DENSE}.weight")
    weight, ws, ws2, input_scale = _tensors(out, *(f"{DENSE}.{k}" for k in ("weight", "weight_scale", "weight_scale_2",
                                                                          "input_scale")))
    # Dequantized here in float64 (the export's fp32 arithmetic rounds code * scale once more: ~1e-8 relative);
    # the tolerance is far below what a wrong dequantization (e.g. via the bf16 forward: 1e-3) would change.
    err = _nvfp4_dequant(weight, ws, ws2) - source.double()
    assert row["weight"]["rel_rms"] == pytest.approx(math.sqrt(err.pow(2).sum() / source.double().pow(2).sum()), rel=1e-6)
    assert row["weight"]["max_abs_err"] == pytest.approx(float(err.abs().max()), rel=1e-6)
    assert 0.01 < row["weight"]["rel_rms"] < 0.3  # NVFP4: a few percent, not zero
    assert row["weight_scale"] == float(ws2) and row["input"]["scale"] == float(input_scale)
    assert row["input"]["calibration_clip_fraction"] == 0.0  # max calibration: nothing above the amax


def test_mxfp4_expert_blocks_lossless_and_requantized(shared_run, probe_ckpt):
    """Blocks the export changed (dequantized export != decoded source), counted independently per expert."""
    out, data = shared_run
    entry = next(e for e in data["experts"] if e["name"] == f"{MOE.format(1)}.experts.*.w1")
    assert entry["source"] == "mxfp4"
    per = entry["per_expert"]
    for i, expert in enumerate(per["expert"]):
        prefix = f"{MOE.format(1)}.experts.{expert}.w1"
        packed, scale = _tensors(probe_ckpt, f"{prefix}.weight_packed", f"{prefix}.weight_scale")
        exported = _nvfp4_dequant(*_tensors(out, f"{prefix}.weight", f"{prefix}.weight_scale", f"{prefix}.weight_scale_2"))
        source = _mxfp4_decode(packed, scale)
        changed = (exported != source).reshape(-1, 16).any(dim=1).sum()
        assert per["requantized_blocks"][i] == int(changed), expert
        assert (per["rel_rms"][i] == 0) == (changed == 0)
    assert per["requantized_blocks"][0] >= 1 and sum(per["requantized_blocks"][1:]) == 0
    assert entry["lossless_blocks"] + entry["requantized_blocks"] == sum(per["blocks"]) == 8 * 64 * 64 // 16


def test_starved_expert_is_named_and_takes_the_shared_scale(shared_run):
    out, data = shared_run
    layers = {layer["module"]: layer for layer in data["coverage"]["layers"]}
    starved = layers[f"{MOE.format(STARVED_LAYER)}.experts"]
    assert [u["expert"] for u in starved["uncovered"]] == [STARVED_EXPERT]
    assert starved["routed"][STARVED_EXPERT] == 0 and starved["depends_on_calibration"]
    (exported,) = _tensors(out, f"{MOE.format(STARVED_LAYER)}.experts.{STARVED_EXPERT}.w1.input_scale")
    scales = starved["uncovered"][0]["scales"]
    assert scales["gate_up_proj"]["input_scale"] == float(exported)
    assert "shared input_scale" in scales["gate_up_proj"]["why"] and "no calibration" in scales["gate_up_proj"]["weight"]
    for layer in layers.values():  # every calibration token goes to top-2 experts
        assert sum(layer["routed"]) == 8 * 32 * 2 and layer["routed_by_rank"] == [layer["routed"]]
    assert [u for name, layer in layers.items() if name != starved["module"] for u in layer["uncovered"]] == []


def test_layers_and_final_logits(shared_run):
    _, data = shared_run
    assert [r["index"] for r in data["layers"]] == [0, 1, 2, 3]
    assert all(r["hidden_rel_rms"] > 0 for r in data["layers"])
    assert data["final"]["tokens"] == 2 * 32 and data["final"]["kl"] > 0 and 0 <= data["final"]["top1_agreement"] <= 1


def test_re_render_from_json(shared_run, tmp_path):
    out, _ = shared_run
    assert report_cli.main([str(out), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").read_text() == (out / "quant_report" / "report.md").read_text()
    (tmp_path / "report.json").write_text(json.dumps({"schema": "modelopt_k3.quant_report", "version": 99}))
    assert report_cli.main([str(tmp_path)]) == 2


def test_refuse_names_the_starved_expert(probe_ckpt, tmp_path, capsys):
    out = tmp_path / "export"
    argv = ["--pyt_ckpt_path", str(probe_ckpt), "--trust_remote_code", "--export_path", str(out), *CALIB]
    assert hf_ptq.main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(rf"layers\.{STARVED_LAYER}\.block_sparse_moe\.experts: experts \[{STARVED_EXPERT}\]", err), err
    assert "--uncovered_experts shared" in err and not out.exists()


def _quantized(ckpt: Path, recipe):
    from modelopt_k3 import load_pretrained, quantize
    from modelopt_k3.data import make_forward_loop

    model = load_pretrained(ckpt, trust_remote_code=True, progress=False)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (2, 32), generator=g) for _ in range(2)]
    return quantize(model, recipe, make_forward_loop(batches, device=torch.device("cpu"), progress=False),
                    verbose=False)


def test_calibrate_all_covers_the_starved_expert(probe_ckpt, tmp_path):
    """--uncovered_experts calibrate_all: every expert calibrates on every token, so the guard passes."""
    out = tmp_path / "export"
    argv = ["--pyt_ckpt_path", str(probe_ckpt), "--trust_remote_code", "--export_path", str(out), *CALIB,
            "--uncovered_experts", "calibrate_all", "--report_heldout", "0"]
    assert hf_ptq.main(argv) == 0
    data = json.loads((out / "quant_report" / "report.json").read_text())
    layer = next(c for c in data["coverage"]["layers"] if c["module"] == f"{MOE.format(STARVED_LAYER)}.experts")
    assert layer["routed"][STARVED_EXPERT] == 0 and layer["handled"] == [8 * 32] * 8
    assert layer["calibrate_all_experts"] and layer["uncovered"] == []
    assert data["layers"] == [] and data["final"] is None  # no held-out sequences asked for


def test_nothing_to_refuse_when_no_expert_scale_depends_on_calibration(probe_ckpt):
    """Constant expert input_amax and a calibrated dense part: the starved expert is noted, not refused."""
    from modelopt_k3.quant.coverage import check_coverage, expert_coverage
    from modelopt_k3.recipe import recipe_from_dict

    recipe = recipe_from_dict({"quant_cfg": [
        {"pattern": "*experts*", "weights": "nvfp4", "inputs": "nvfp4", "input_amax": 2688.0},
        {"pattern": "*mlp.down_proj", "weights": "nvfp4", "inputs": "nvfp4"},
    ]})
    model = _quantized(probe_ckpt, recipe)
    coverage = expert_coverage(model, model.modelopt_k3.spec)
    notes = check_coverage(coverage, min_tokens=1, policy="refuse")
    assert len(notes) == 1 and "none of their scales depends on calibration" in notes[0]
    layer = next(c for c in coverage if c.module == f"{MOE.format(STARVED_LAYER)}.experts")
    assert layer.uncovered(1) == [STARVED_EXPERT] and not layer.depends_on_calibration()


def test_no_calibration_forward_counts_nothing(probe_ckpt):
    """The converter's recipe (constant expert input_amax, nothing else calibrated) runs no forward: the
    report says tokens were not counted instead of listing every expert as starved."""
    from modelopt_k3 import load_pretrained, quantize
    from modelopt_k3.quant.coverage import check_coverage
    from modelopt_k3.report import report

    model = load_pretrained(probe_ckpt, trust_remote_code=True, progress=False)
    quantize(model, "models/moonshotai/Kimi-K3/nvfp4_experts", None, verbose=False)
    data = report(model, None)
    assert data["coverage"] == {"min_expert_tokens": 1, "policy": "refuse", "counted": False, "layers": []}
    assert check_coverage([], min_tokens=1, policy="refuse") == []
    assert {e["source"] for e in data["experts"]} == {"mxfp4"} and data["modules"] == []
