"""The conformance command as a CI gate (``tools/conformance/run.py``), without any engine: arguments validated
before anything is installed, built or written; exit 1 on a disagreement; results in ``--out``, the committed
matrix and report regenerated only with ``--update_committed`` (rows in the matrix's order, engines by name, the
report's hand-written sections kept); install progress and an explicit PIP_CONSTRAINT (``venv.py``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from modelopt_k3.check import DIFFERENT, LOADS, REFUSES
from tools.conformance import report, run, venv
from tools.conformance.matrix import CELLS


def _observed(verdict: str) -> dict:
    load = {"tensors": 3, "landed_byte_equal": 3, "not_landed": [], "params_never_written": {}}
    if verdict == DIFFERENT:
        load["not_landed"] = ["x.weight"]
    return {"outcome": "ran", "verdict": verdict, "load": load}


def _row(cell_id: str, check: str, seen: dict[str, str]) -> dict:
    return {"id": cell_id, "how": "hf_ptq", "recipe": "r", "tiny": "default", "about": "a",
            "check": {e: {"verdict": check} for e in ("vllm", "sglang", "trtllm")},
            "observed": {e: _observed(v) for e, v in seen.items()}}


@pytest.fixture
def no_side_effects(monkeypatch, tmp_path):
    """Run in an empty directory; any install, export build or engine run fails the test."""
    monkeypatch.chdir(tmp_path)

    def forbidden(*a, **k):
        raise AssertionError("the command went past argument validation")

    monkeypatch.setattr(run, "run_matrix", forbidden)
    monkeypatch.setattr(venv, "ensure_venv", forbidden)
    return tmp_path


@pytest.mark.parametrize(("argv", "message"), [
    (["--cells", "preset-nvfp4,no-such-cell"], "unknown cell id(s) ['no-such-cell']"),
    (["--cells", ","], "unknown cell id(s)"),
    (["--engine", "vllm"], "expected one of"),
    (["--engine", "trtllm==1.0"], "expected one of"),
    (["--engine", "vllm==0.33.0", "--engine", "vllm==0.34.0"], "one engine twice"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--timeout", "-5"], "--timeout must be > 0"),
    (["--pip_constraint", "missing.txt"], "no such file"),
])
def test_bad_arguments_stop_before_anything_happens(no_side_effects, capsys, argv, message):
    with pytest.raises(SystemExit) as done:
        run.main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("python -m tools.conformance: error:"), err
    assert list(no_side_effects.iterdir()) == []  # nothing written, nothing downloaded


def _fake_run(result: dict):
    return lambda engines, **kw: json.loads(json.dumps(result))


def _committed(monkeypatch, tmp_path: Path) -> tuple[Path, Path]:
    js, md = tmp_path / "committed" / "engine_conformance.json", tmp_path / "committed" / "ENGINE_CONFORMANCE.md"
    monkeypatch.setattr(run, "COMMITTED_JSON", js)
    monkeypatch.setattr(run, "COMMITTED_DOC", md)
    return js, md


def test_a_disagreement_exits_1_and_only_out_is_written(monkeypatch, tmp_path, capsys):
    js, md = _committed(monkeypatch, tmp_path)
    ids = [c.id for c in CELLS]
    result = {"engines": {"vllm": "0.33.0", "sglang": "0.5.23"},  # not in name order
              "cells": [_row(ids[1], LOADS, {"vllm": LOADS, "sglang": LOADS}),
                        _row(ids[0], REFUSES, {"vllm": REFUSES, "sglang": DIFFERENT})]}
    monkeypatch.setattr(run, "run_matrix", _fake_run(result))
    out = tmp_path / "out"
    assert run.main(["--out", str(out), "--cells", f"{ids[1]},{ids[0]}"]) == 1
    err = capsys.readouterr().err
    assert "1 disagreement(s)" in err and f"{ids[0]} (sglang)" in err
    doc = json.loads((out / "engine_conformance.json").read_text())
    assert [r["id"] for r in doc["cells"]] == [ids[0], ids[1]]  # the matrix's order, not the run's
    assert list(doc["engines"]) == ["sglang", "vllm"]
    assert doc["cells"][0]["agree"] == {"sglang": False, "vllm": True}
    assert (out / "ENGINE_CONFORMANCE.md").exists() and not js.exists() and not md.exists()
    # Every verdict agreeing (or not observed): exit 0.
    result["cells"][1]["observed"]["sglang"] = {"outcome": "driver timed out"}
    monkeypatch.setattr(run, "run_matrix", _fake_run(result))
    assert run.main(["--out", str(out)]) == 0


def test_update_committed_merges_a_subset_in_order_and_keeps_the_reports_own_sections(monkeypatch, tmp_path):
    js, md = _committed(monkeypatch, tmp_path)
    ids = [c.id for c in CELLS]
    old = {"engines": {"sglang": "0.5.22", "vllm": "0.33.0"},
           "cells": [_row(i, LOADS, {"vllm": LOADS, "sglang": LOADS}) for i in ids[:3]]}
    report.write_report(old, js, md, order=ids)
    md.write_text(md.read_text() + "\n## What the engines did (findings)\n\nhand-written\n\n## Running it\n\nsteps\n")
    fresh = {"engines": {"sglang": "0.5.23"}, "cells": [_row(ids[1], REFUSES, {"sglang": REFUSES})]}
    monkeypatch.setattr(run, "run_matrix", _fake_run(fresh))
    assert run.main(["--out", str(tmp_path / "out"), "--cells", ids[1], "--engine", "sglang==0.5.23",
                     "--update_committed"]) == 0
    doc = json.loads(js.read_text())
    assert [r["id"] for r in doc["cells"]] == ids[:3] and doc["engines"] == {"sglang": "0.5.23", "vllm": "0.33.0"}
    assert doc["cells"][1]["check"]["sglang"]["verdict"] == REFUSES
    text = md.read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == [*report.ENGINE_SECTIONS, "## What the engines did (findings)", "## Running it"]
    assert "hand-written" in text and text.count("## Cells") == 1
    # Regenerating again changes nothing (stable output).
    before = text
    assert run.main(["--out", str(tmp_path / "out"), "--cells", ids[1], "--engine", "sglang==0.5.23",
                     "--update_committed"]) == 0
    assert md.read_text() == before


def test_a_full_update_of_the_engines_rows_keeps_the_committed_trtllm_replay(monkeypatch, tmp_path):
    """``python -m tools.conformance --update_committed`` rewrites vLLM's and SGLang's rows; the TensorRT-LLM rows
    (``trtllm_replay``, written by ``python -m tools.conformance.trtllm``) and their report section stay."""
    js, md = _committed(monkeypatch, tmp_path)
    ids = [c.id for c in CELLS]
    replay = {"sources": [], "stubs": [{"name": "s", "why": "w"}],
              "cells": [{"id": ids[0], "about": "a", "replay": {"outcome": "resolves"}, "calls": {"configs": "x"},
                         "headers": [], "check": {"verdict": LOADS}, "disagreements": []}]}
    report.write_report({"engines": {"vllm": "0.33.0"}, "trtllm_replay": replay,
                         "cells": [_row(ids[0], LOADS, {"vllm": LOADS})]}, js, md, order=ids)
    assert report.REPLAY_SECTION in md.read_text()
    fresh = {"engines": {"vllm": "0.33.0", "sglang": "0.5.23"},
             "cells": [_row(i, LOADS, {"vllm": LOADS, "sglang": LOADS}) for i in ids[:2]]}
    monkeypatch.setattr(run, "run_matrix", _fake_run(fresh))
    assert run.main(["--out", str(tmp_path / "out"), "--update_committed"]) == 0
    doc = json.loads(js.read_text())
    assert doc["trtllm_replay"] == replay and [r["id"] for r in doc["cells"]] == ids[:2]
    assert md.read_text().count(report.REPLAY_SECTION) == 1


def test_install_progress_lines_and_the_full_log(tmp_path):
    said: list[str] = []
    script = "print('Collecting vllm==0.33.0'); print('  noise'); print('Successfully installed vllm-0.33.0')"
    venv.run_logged([sys.executable, "-c", script], tmp_path / "install.log", dict(os.environ), label="vllm==0.33.0",
                    say=said.append)
    assert said == ["  [vllm==0.33.0] Collecting vllm==0.33.0", "  [vllm==0.33.0] Successfully installed vllm-0.33.0"]
    assert "noise" in (tmp_path / "install.log").read_text()
    with pytest.raises(RuntimeError, match="exited 3; its output: .*bad.log"):
        venv.run_logged([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "bad.log", dict(os.environ),
                        label="x", say=said.append)


def test_pip_constraint_is_never_changed_silently(monkeypatch):
    said: list[str] = []
    monkeypatch.setenv("PIP_CONSTRAINT", "/etc/pip-constraints.txt")
    assert venv.install_env(None, said.append)["PIP_CONSTRAINT"] == "/etc/pip-constraints.txt"
    assert "applies to the engine installs" in said[-1]
    assert venv.install_env("", said.append)["PIP_CONSTRAINT"] == ""
    assert "--pip_constraint" in said[-1]
    monkeypatch.delenv("PIP_CONSTRAINT")
    said.clear()
    assert "PIP_CONSTRAINT" not in venv.install_env(None, said.append) and said == []


def test_the_harness_is_not_part_of_the_library():
    """It builds checkpoints and runs hf_ptq: a tool (tools/conformance), which no library module imports."""
    import importlib.util

    import modelopt_k3

    assert importlib.util.find_spec("modelopt_k3.check.conformance") is None
    root = Path(modelopt_k3.__file__).parent
    assert not [p for p in root.rglob("*.py") if "tools.conformance" in p.read_text() or "from tools" in p.read_text()]


def test_regenerating_the_committed_matrix_and_report_changes_nothing(tmp_path):
    """The committed files are a fixed point of the writer: same JSON, same report, every section kept."""
    root = Path(__file__).parents[2]
    js, md = root / run.COMMITTED_JSON, root / run.COMMITTED_DOC
    doc = json.loads(js.read_text())
    report.write_report(doc, tmp_path / "m.json", tmp_path / "r.md", order=[c.id for c in CELLS],
                        keep_sections_of=md, generated=doc["generated"])
    assert (tmp_path / "m.json").read_text() == js.read_text()
    assert (tmp_path / "r.md").read_text() == md.read_text()


def test_out_holding_a_planted_link_is_refused_before_anything_runs(no_side_effects, capsys):
    """``--out`` goes through the owned-destination writer: a link at a result's name (to a file the user keeps)
    is refused at argument validation, before any install or run; the link's target is never written."""
    keep = no_side_effects / "keep.txt"
    keep.write_text("mine")
    out = no_side_effects / "results"
    out.mkdir()
    os.symlink(keep, out / run.JSON_NAME)
    with pytest.raises(SystemExit) as done:
        run.main(["--out", str(out)])
    assert done.value.code == 2
    assert "is a symlink" in capsys.readouterr().err and keep.read_text() == "mine"


def test_the_committed_files_are_the_repositorys_wherever_it_runs_and_never_written_through_a_link(tmp_path):
    repo = Path(run.__file__).resolve().parents[2]
    assert repo / "tests" / "data" / "engine_conformance.json" == run.COMMITTED_JSON  # was: relative to the cwd
    assert repo / "docs" / "ENGINE_CONFORMANCE.md" == run.COMMITTED_DOC
    from modelopt_k3.files.paths import DestinationError

    keep = tmp_path / "keep.json"
    keep.write_text("mine")
    js, md = tmp_path / "m.json", tmp_path / "r.md"
    os.symlink(keep, js)
    doc = json.loads(run.COMMITTED_JSON.read_text())
    with pytest.raises(DestinationError, match="is a symlink"):
        report.write_report(doc, js, md, order=[c.id for c in CELLS], generated=doc["generated"])
    assert keep.read_text() == "mine" and js.is_symlink()
