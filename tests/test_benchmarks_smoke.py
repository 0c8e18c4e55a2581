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
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import run as bench_run
from benchmarks.common import Figure, FigureError

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
        if fig["verdict"] == "skipped":  # a noise-bound figure at quick sizes: said, with why, never a number
            assert fig["skipped"] and fig["target"] is None and fig["passed"] is None, name
            continue
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
    assert all(line.rstrip(" |").endswith(("met", "**missed**", "report")) or "**skipped: " in line
               for line in rows[: len(figures)])
    missed = [f["title"] for f in figures if f["verdict"] == "missed"]
    assert all(f"**{title}**" in table for title in missed)  # listed with its bound under "Targets missed"


def _figure(name: str, ratio: float, target: float | None, **kw) -> Figure:
    return Figure(name=name, area="fake", title=name, ours={"label": "ours", "value": ratio},
                  reference={"label": "ref", "value": 1.0},
                  ratio=ratio, target=target, target_text=kw.pop("target_text", f">= {target}"), **kw)


def test_a_target_needs_a_bound_and_every_figure_a_target_text():
    with pytest.raises(ValueError, match="no bound"):
        _figure("f", 1.0, 2.0)
    with pytest.raises(ValueError, match="target_text"):
        _figure("f", 1.0, None, target_text="")
    assert _figure("f", 1.0, 2.0, details={"bound": "memory"}).bound == "memory"


def test_a_measured_figure_names_what_each_side_ran():
    """RESULTS.md lists what each side ran; "ours = ; reference = " was printed for the layerwise figures."""
    with pytest.raises(ValueError, match="reference side ran"):
        Figure(name="f", area="a", title="f", ours={"label": "ours", "value": 1.0}, reference={"value": 1.0},
               ratio=1.0, target_text="report only")
    skipped = Figure.not_measured("f", "a", "f", "no peer", target=None, target_text="report only")
    assert skipped.verdict == "skipped"  # nothing ran, so nothing to name


FAKE_AREA = """
import os
from benchmarks.common import Figure

def _figure(name, ratio, target, **kw):
    return Figure(name=name, area="fake", title=name, ours={"label": "ours", "value": ratio},
                  reference={"label": "ref", "value": 1.0},
                  ratio=ratio, target=target, target_text=kw.pop("target_text", f">= {target}"), **kw)

def run(ctx):
    check_ok = os.environ["FAKE_CHECK_OK"] == "1"
    return [
        _figure("met", 3.0, 2.0, bound="b"),
        _figure("missed", 1.0, 2.0, bound="what bounds it: the copy bandwidth"),
        _figure("reported", 1.0, None, target_text="report only"),
        _figure("checked", 3.0, 2.0, bound="b", checks={"bit_equal_to_reference": check_ok}),
    ]
"""


def _run_fake_areas(tmp_path, monkeypatch, areas: dict[str, str]) -> tuple[int, dict, str]:
    """``benchmarks.run.main`` over areas whose modules are the given sources (each runs in its own process)."""
    pkg = tmp_path / "fake_areas"
    pkg.mkdir(exist_ok=True)
    for name, source in areas.items():
        (pkg / f"fake_{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(pkg))  # the area processes get the runner's sys.path
    monkeypatch.setattr(bench_run, "AREAS", {name: f"fake_{name}" for name in areas})
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # main sets it for its subprocesses: restored after
    argv = ["--only", ",".join(areas), "--out", str(tmp_path), "--workdir", str(tmp_path / "w"),
            "--threads", str(torch.get_num_threads())]  # and leaves this process's torch threads as they are
    code = bench_run.main(argv)
    return code, json.loads((tmp_path / "results.json").read_text()), (tmp_path / "RESULTS.md").read_text()


@pytest.mark.parametrize("check_ok, exit_code", [(True, 0), (False, 1)])
def test_a_missed_target_is_reported_and_only_a_failed_check_fails_the_run(tmp_path, monkeypatch, check_ok,
                                                                           exit_code):
    monkeypatch.setenv("FAKE_CHECK_OK", "1" if check_ok else "0")
    code, results, table = _run_fake_areas(tmp_path, monkeypatch, {"fake": FAKE_AREA})
    assert code == exit_code
    assert [f["verdict"] for f in results["figures"]] == ["met", "missed", "report", "met"]
    assert results["targets_met"] is False and results["correct"] is check_ok
    assert "| **missed** |" in table and "what bounds it: the copy bandwidth" in table
    assert ("wrong: bit_equal_to_reference" in table) is not check_ok


@pytest.mark.parametrize("field, value", [("ratio", -0.28), ("ratio", float("nan")), ("ratio", float("inf")),
                                          ("ours", {"value": -46.7}), ("reference", {"median": float("nan")})])
def test_an_impossible_figure_is_an_error_not_a_verdict(field, value):
    """A negative RSS difference gave "packed_calibration_peak" ratios of -0.28 reported as met (<= 0.5)."""
    kw = {"ours": {"label": "o", "value": 1.0}, "reference": {"label": "r", "value": 1.0}, "ratio": 0.2,
          field: {"label": "x", **value} if isinstance(value, dict) else value}
    with pytest.raises(FigureError, match="impossible"):
        Figure(name="f", area="a", title="f", target=0.5, target_text="<= 0.5", higher_is_better=False,
               bound="b", **kw)


def test_an_area_that_measures_an_impossible_figure_fails_the_run(tmp_path, monkeypatch):
    broken = FAKE_AREA.replace('_figure("met", 3.0, 2.0', '_figure("met", -3.0, 2.0')
    monkeypatch.setenv("FAKE_CHECK_OK", "1")
    code, results, table = _run_fake_areas(tmp_path, monkeypatch, {"broken": broken})
    assert code == 1 and results["figures"] == [] and "FigureError" in results["errors"]["broken"]
    assert "## Areas that failed to run" in table


def test_a_targeted_figure_not_measured_is_listed_and_fails_the_run(tmp_path, monkeypatch):
    area = (
        "from benchmarks.common import Figure\n"
        "def run(ctx):\n"
        "    return [Figure.not_measured('peer/speedup', 'peerless', 'ours vs the peer', 'no peer: not set up',\n"
        "                                target=5.0, target_text='>= 5x'),\n"
        "            Figure.not_measured('peer/rss', 'peerless', 'peer RSS', 'no peer', target=None,\n"
        "                                target_text='report only')]\n"
    )
    code, results, table = _run_fake_areas(tmp_path, monkeypatch, {"peerless": area})
    assert code == 1 and results["correct"] is True
    assert [f["verdict"] for f in results["figures"]] == ["skipped", "skipped"]
    assert results["targets_not_measured"] == ["peer/speedup"]
    assert "**skipped: no peer: not set up**" in table and "## Targeted figures not measured" in table


def test_every_area_runs_in_a_fresh_process(tmp_path, monkeypatch):
    """What one area leaves in its process (module state, allocator high-water marks) never reaches the next:
    figures do not depend on the order of areas."""
    leaker = (
        "import os\nimport benchmarks.common as common\nfrom benchmarks.common import Figure\n"
        "def run(ctx):\n"
        "    common._LEFT_BEHIND = os.getpid()\n"
        "    return [Figure(name='pid', area='a', title='pid', ours={'label': 'o'}, reference={'label': 'r'}, ratio=float(os.getpid()),\n"
        "                   target_text='report only')]\n"
    )
    reader = (
        "import os\nimport benchmarks.common as common\nfrom benchmarks.common import Figure\n"
        "def run(ctx):\n"
        "    seen = float(hasattr(common, '_LEFT_BEHIND'))\n"
        "    return [Figure(name='seen', area='b', title='seen', ours={'label': 'o'}, reference={'label': 'r'}, ratio=seen,\n"
        "                   target_text='report only'),\n"
        "            Figure(name='pid', area='b', title='pid', ours={'label': 'o'}, reference={'label': 'r'}, ratio=float(os.getpid()),\n"
        "                   target_text='report only')]\n"
    )
    code, results, _ = _run_fake_areas(tmp_path, monkeypatch, {"a": leaker, "b": reader})
    assert code == 0, results["errors"]
    ratios = {(f["area"], f["name"]): f["ratio"] for f in results["figures"]}
    assert ratios[("b", "seen")] == 0.0
    assert len({ratios[("a", "pid")], ratios[("b", "pid")], float(os.getpid())}) == 3


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
    figures = convert_area._peer_figures(r)
    assert [(f.name, f.verdict) for f in figures] == [("convert_peer/speedup_p1", "skipped"),
                                                       ("convert_peer/floor_p1", "report")]
    assert figures[0].target == 5.0 and figures[0].skipped == f"no peer: {why}"
    assert f"**Peer skipped**: {why}" in convert_area._peer_markdown(r)


def test_every_name_the_benchmarks_import_from_the_package_exists():
    # The benchmarks import the package lazily, inside the functions an area runs; an area the quick run skips
    # (wall_time, convert, the peers) would otherwise find a renamed function only in a full run.
    import ast

    missing = []
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("modelopt_k3"):
                module = importlib.import_module(node.module)
                missing += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                            if not hasattr(module, a.name) and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
    assert not missing, missing
