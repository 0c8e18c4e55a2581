"""Issue 39 item 2: a ``--layerwise`` run writes the quantization report, and it equals the resident run's
field for field (weight rows, input settings and counters, coverage, the held-out per-layer hidden error, KL
and top-1) where the exports are equal: tiny Kimi-K3 and Qwen3-MoE in one process, Kimi-K3 under expert
parallelism on two ranks. The held-out passes stream through each layer (``--eval_kl``/``--report_heldout``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _mp import run_ranks

from layerwise.test_layerwise import MODELS, assert_same_export, ptq

ENV = {"MODELOPT_K3_DIST_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Every leaf where two report trees differ, by path (floats compared exactly: the sums are added in one
    order either way)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}.{k}: only in one" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out += differences(a[k], b[k], f"{where}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} vs {len(b)} entries"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b and type(a) is type(b) else [f"{where}: {a!r} vs {b!r}"]


def assert_same_report(resident: Path, layerwise: Path) -> dict[str, Any]:
    """``report.json`` equal leaf for leaf, and its text form (``report.md``) byte for byte."""
    a = json.loads((resident / "quant_report" / "report.json").read_text())
    b = json.loads((layerwise / "quant_report" / "report.json").read_text())
    diff = differences(a, b)
    assert diff == [], diff[:10]
    assert (resident / "quant_report" / "report.md").read_bytes() == (layerwise / "quant_report" / "report.md").read_bytes()
    return a


def test_differences_names_a_wrong_row():
    a = {"modules": [{"name": "x", "weight": {"rel_rms": 0.1}}], "final": {"kl": 0.5}}
    assert differences(a, json.loads(json.dumps(a))) == []
    b = {"modules": [{"name": "x", "weight": {"rel_rms": 0.1000001}}], "final": {"kl": 0.5}}
    assert differences(a, b) == [".modules[0].weight.rel_rms: 0.1 vs 0.1000001"]
    assert differences(a, {**a, "final": {"kl": 0.5, "top1": 1.0}}) == [".final.top1: only in one"]
    assert differences({"n": 1}, {"n": 1.0}) == [".n: 1 vs 1.0"]


def _check_contents(data: dict[str, Any], layers: int, held_out: int) -> None:
    """The report is not trivially equal: every part present, the held-out figures computed."""
    assert data["modules"] and data["experts"] and data["coverage"]["layers"]
    assert len(data["layers"]) == layers and all(entry["hidden_rel_rms"] > 0 for entry in data["layers"])
    assert data["final"]["kl"] > 0 and 0 <= data["final"]["top1_agreement"] <= 1
    assert data["run"]["held_out_sequences"] == held_out
    inputs = [m["input"] for m in data["modules"] if m["input"] is not None]
    assert inputs and all(i["held_out_values"] > 0 and i["calibration_values"] > 0 for i in inputs)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["kimi_k3", "qwen3_moe"])
def test_layerwise_report_equals_the_resident_report(model, tmp_path: Path, capsys):
    ckpt = MODELS[model](tmp_path / "src")
    extra = ["--kv_cache_qformat", "fp8", "--eval_kl", "3"] if model == "kimi_k3" else ["--report_heldout", "2"]
    base = ["--pyt_ckpt_path", ckpt, "--trust_remote_code", *extra]
    assert ptq(*base, "--export_path", tmp_path / "resident") == ptq(*base, "--export_path", tmp_path / "layerwise",
                                                                       "--layerwise")
    assert_same_export(tmp_path / "resident", tmp_path / "layerwise")
    data = assert_same_report(tmp_path / "resident", tmp_path / "layerwise")
    _check_contents(data, layers=len(data["layers"]), held_out=3 if model == "kimi_k3" else 2)
    assert len(data["layers"]) >= 2
    if model == "kimi_k3":  # --eval_kl prints the same line for both
        said = [line for line in capsys.readouterr().out.splitlines() if "KL(original || quantized)" in line]
        assert len(said) == 2 and said[0] == said[1] and "on 3 held-out sequences" in said[0], said


def _ptq(argv: list[str]) -> int:
    return ptq(*argv)


@pytest.mark.multiprocess
def test_ep2_layerwise_report_equals_the_ep2_resident_report(tmp_path: Path):
    from modelopt_k3.testing import make_tiny_kimi_k3

    ckpt = make_tiny_kimi_k3(tmp_path / "src", num_experts=16)
    base = ["--pyt_ckpt_path", str(ckpt), "--trust_remote_code", "--kv_cache_qformat", "fp8", "--eval_kl", "4"]
    for name, flags in (("resident", []), ("layerwise", ["--layerwise"])):
        results = run_ranks(2, _ptq, [*base, "--export_path", str(tmp_path / name), *flags], timeout=400, env=ENV)
        assert [x.exitcode for x in results] == [0, 0], [x.traceback for x in results]
    assert_same_export(tmp_path / "resident", tmp_path / "layerwise")
    data = assert_same_report(tmp_path / "resident", tmp_path / "layerwise")
    _check_contents(data, layers=len(data["layers"]), held_out=4)
    assert data["run"]["world_size"] == 2
    # Both ranks' shares: routed tokens counted on each rank, dense rows written by each (global i % world owner).
    assert all(len(layer["routed_by_rank"]) == 2 for layer in data["coverage"]["layers"])
