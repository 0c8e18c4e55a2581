"""Smoke test of the benchmark suite: ``python -m benchmarks --quick`` runs and judges every figure.

Quick sizes say nothing about speed, so this test asserts no speed: it asserts that the benchmarks did
their own judging -- every figure carries a target (or says it is report-only) and a verdict, every
missed target says what bounds it, every correctness check the benchmarks make on their outputs
passed, and the exit status reflects correctness only (a missed target exits 0).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


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
