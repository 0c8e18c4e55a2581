"""Smoke test of the benchmark suite: ``python -m benchmarks --quick`` runs and judges every figure.

Quick sizes say nothing about speed, so this test asserts no speed: it asserts that the benchmarks did
their own judging -- every figure carries a target (or says it is report-only) and a verdict, every
missed target says what bounds it, every correctness check the benchmarks make on their outputs
passed, and the exit status reflects correctness only (a missed target exits 0). The runner's judging
itself is checked on a fake area (fast): met / missed-with-bound / report, and a failed check exits 1.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import run as bench_run
from benchmarks.common import Figure

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.multiprocess  # the EP area runs gloo ranks
def test_benchmarks_quick_judges_every_figure(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out), "--workdir", str(tmp_path / "work")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    results = json.loads((out / "results.json").read_text())
    assert results["errors"] == {}, results["errors"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert results["correct"] is True and results["suite"]["quick"] is True
    for key in ("cpu_model", "cpu_cores_logical", "memory_total_bytes", "torch", "transformers",
                "compressed_tensors", "safetensors", "date"):
        assert results["machine"][key], key
    figures = results["figures"]
    assert {"numerics", "io", "ep", "memory"} <= {f["area"] for f in figures}
    checked = [name for f in figures for name in f["checks"]]
    assert "bit_equal_to_reference" in checked, "the numerics benchmark checks its outputs"
    for fig in figures:
        name = fig["name"]
        assert fig["target_text"], name
        assert fig["verdict"] == {True: "met", False: "missed", None: "report"}[fig["passed"]], name
        assert (fig["verdict"] == "report") == (fig["target"] is None), name
        if fig["target"] is not None:
            assert fig["bound"], f"{name}: a target without what bounds it"
            assert math.isfinite(fig["target"]), name
        if fig["verdict"] == "missed":
            assert fig["shortfall"] and fig["bound"], name
        assert fig["failed_checks"] == [] and all(fig["checks"].values()), name
        assert fig["ratio"] == fig["ratio"], name  # no NaN
        if "median" in fig["ours"]:
            assert fig["ours"]["min"] <= fig["ours"]["median"] <= fig["ours"]["max"], name
    table = (out / "RESULTS.md").read_text()
    assert "| figure |" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| figure")]
    assert len(rows) >= len(figures)
    assert all(line.rstrip(" |").endswith(("met", "**missed**", "report")) for line in rows[: len(figures)])
    missed = [f["title"] for f in figures if f["verdict"] == "missed"]
    assert all(f"**{title}**" in table for title in missed)  # listed with its bound under "Targets missed"


def _figure(name: str, ratio: float, target: float | None, **kw) -> Figure:
    return Figure(name=name, area="fake", title=name, ours={"value": ratio}, reference={"value": 1.0},
                  ratio=ratio, target=target, target_text=kw.pop("target_text", f">= {target}"), **kw)


def test_a_target_needs_a_bound_and_every_figure_a_target_text():
    with pytest.raises(ValueError, match="no bound"):
        _figure("f", 1.0, 2.0)
    with pytest.raises(ValueError, match="target_text"):
        _figure("f", 1.0, None, target_text="")
    assert _figure("f", 1.0, 2.0, details={"bound": "memory"}).bound == "memory"


@pytest.mark.parametrize("check_ok, exit_code", [(True, 0), (False, 1)])
def test_a_missed_target_is_reported_and_only_a_failed_check_fails_the_run(tmp_path, monkeypatch, check_ok,
                                                                           exit_code):
    figures = [
        _figure("met", 3.0, 2.0, bound="b"),
        _figure("missed", 1.0, 2.0, bound="what bounds it: the copy bandwidth"),
        _figure("reported", 1.0, None, target_text="report only"),
        _figure("checked", 3.0, 2.0, bound="b", checks={"bit_equal_to_reference": check_ok}),
    ]
    fake = type(sys)("fake_bench_area")
    fake.run = lambda ctx: figures
    monkeypatch.setitem(sys.modules, "fake_bench_area", fake)
    monkeypatch.setattr(bench_run, "AREAS", {"fake": "fake_bench_area"})
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # main sets it for its subprocesses: restored after
    argv = ["--only", "fake", "--out", str(tmp_path), "--workdir", str(tmp_path / "w"),
            "--threads", str(torch.get_num_threads())]  # and leaves this process's torch threads as they are
    assert bench_run.main(argv) == exit_code
    results = json.loads((tmp_path / "results.json").read_text())
    assert [f["verdict"] for f in results["figures"]] == ["met", "missed", "report", "met"]
    assert results["targets_met"] is False and results["correct"] is check_ok
    table = (tmp_path / "RESULTS.md").read_text()
    assert "| **missed** |" in table and "what bounds it: the copy bandwidth" in table
    assert ("wrong: bit_equal_to_reference" in table) is not check_ok


def test_the_converter_peer_is_skipped_saying_so_when_absent(monkeypatch, tmp_path):
    """ModelOpt's Kimi-K3 converter is no dependency: without it the peer benchmark measures ours and the
    copy floor and says in RESULTS.md why the peer is missing (no speed-up figure is made up)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_convert_peer as peer

    from benchmarks import convert_area

    for var in ("MODELOPT_K3_PEER_PYTHON", "MODELOPT_K3_PEER_SCRIPT"):
        monkeypatch.delenv(var, raising=False)
    assert peer.find_peer(None, None)[0] is None
    missing, why = peer.find_peer(sys.executable, str(tmp_path / "quantize_to_nvfp4.py"))
    assert missing is None and "does not exist" in why
    (tmp_path / "quantize_to_nvfp4.py").write_text("")
    if importlib.util.find_spec("modelopt") is None:  # the project's own environment never has it
        missing, why = peer.find_peer(sys.executable, str(tmp_path / "quantize_to_nvfp4.py"))
        assert missing is None and "cannot import modelopt" in why
    sample = {"s": 2.0, "tree_peak_rss": 4e8, "max_single_rss": 4e8}
    runs = {"1": {"samples": {"copy": [{"s": 1.0}], "ours": [sample]}, "load_average_before_after": [(1,) * 3] * 2}}
    r = {"peer": {"found": False, "note": why}, "repeats": 1, "by_parallelism": peer.summarize(runs, 2e9, 6e8),
         "checkpoint": {"bytes": 2e9, "shards": 4, "largest_shard_bytes": 6e8}}
    assert [f.name for f in convert_area._peer_figures(r)] == ["convert_peer/floor_p1"]
    assert f"**Peer skipped**: {why}" in convert_area._peer_markdown(r)
