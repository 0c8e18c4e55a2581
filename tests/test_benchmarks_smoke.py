"""Smoke test of the benchmark suite: ``python -m benchmarks --quick`` runs and writes its results.

No target is asserted (quick sizes say nothing about speed); the suite's exit status is 0 or 1
(1 = a target missed), never a crash, and every area that ran produced figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_benchmarks_quick_writes_results(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out), "--workdir", str(tmp_path / "work")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["errors"] == {}, results["errors"]
    assert results["suite"]["quick"] is True
    for key in ("cpu_model", "cpu_cores_logical", "memory_total_bytes", "torch", "transformers",
                "compressed_tensors", "safetensors", "date"):
        assert results["machine"][key], key
    areas = {f["area"] for f in results["figures"]}
    assert {"numerics", "io", "ep"} <= areas, areas
    for fig in results["figures"]:
        assert fig["passed"] in (True, False, None) and fig["ratio"] == fig["ratio"], fig["name"]  # no NaN
        if "median" in fig["ours"]:
            assert fig["ours"]["min"] <= fig["ours"]["median"] <= fig["ours"]["max"], fig["name"]
    assert (proc.returncode == 0) == results["passed"]
    assert "| figure |" in (out / "RESULTS.md").read_text()
