"""Locks and signals, in process (cheap): one run per destination from the preflight on, a lock a crash left
empty is stale (said so), SIGINT and SIGTERM end in one line with 130/143 and leave nothing, the owner record
included.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from faults.helpers import MIRROR, SMALL, temp_leftovers, tree_digest
from modelopt_k3.convert import STATE_DIR, convert_checkpoint
from modelopt_k3.files.locks import export_lock_path

INTERRUPTED = 128 + signal.SIGINT


def _ptq_args(src: Path, out: Path, *extra) -> list[str]:
    return ["--pyt_ckpt_path", str(src), "--trust_remote_code", "--export_path", str(out), *SMALL, *extra]


def _preflight(src: Path, out: Path):
    import torch

    from modelopt_k3.cli.hf_ptq import _preflight as preflight
    from modelopt_k3.cli.hf_ptq import build_parser
    from modelopt_k3.export.layouts import MODELOPT
    from modelopt_k3.run.plan import PtqConfig

    config = PtqConfig.from_namespace(build_parser().parse_args(_ptq_args(src, out)))
    return preflight(config, MODELOPT, SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu")), src, True)


def test_two_runs_on_one_export_path_cannot_both_pass_the_preflight(tiny_ckpt, tmp_path, run_tool) -> None:
    out = tmp_path / "new" / "export"  # its parent is made for the lock, and removed with it
    first = _preflight(tiny_ckpt, out)
    try:
        assert export_lock_path(out).is_file()
        t0 = time.perf_counter()
        rc, _, err = run_tool("ptq", _ptq_args(tiny_ckpt, out))
        assert time.perf_counter() - t0 < 5.0
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1, err
        assert f"another run is exporting to {out}" in lines[0] and "is held by another run (pid" in lines[0]
    finally:
        first.close()
    assert not (tmp_path / "new").exists()


def test_a_refused_preflight_holds_no_lock(tiny_ckpt, tmp_path, run_tool) -> None:
    out = tmp_path / "export"
    rc, _, err = run_tool("ptq", _ptq_args(tiny_ckpt, out, "--dataset", str(tmp_path / "missing.txt")))
    assert rc == 2 and "--dataset" in err
    assert temp_leftovers(out) == [] and not out.exists()


def test_an_empty_export_lock_left_by_a_crash_is_stale_and_said_so(tiny_ckpt, tmp_path) -> None:
    out = tmp_path / "export"
    export_lock_path(out).write_bytes(b"")
    ctx = _preflight(tiny_ckpt, out)
    ctx.close()
    assert any("is empty or unreadable, so no live run holds it" in n for n in ctx.notes), ctx.notes
    assert temp_leftovers(out) == []


def test_an_empty_converter_lock_left_by_a_crash_is_stale_and_said_so(tiny_ckpt, tmp_path) -> None:
    """Before: "appeared meanwhile", forever."""
    dst = tmp_path / "out"
    locks = dst / STATE_DIR / "locks"
    locks.mkdir(parents=True)
    (locks / "rank-00000.json").write_bytes(b"")
    report = convert_checkpoint(tiny_ckpt, dst, MIRROR)
    assert report.complete
    assert any("is empty or unreadable, so no live run holds it" in n for n in report.notes), report.notes
    assert temp_leftovers(dst) == []


def test_converter_sigint_is_one_line_exit_130_and_leaves_nothing(tiny_ckpt, tmp_path, run_tool,
                                                                  monkeypatch) -> None:
    from modelopt_k3.convert import shard

    dst = tmp_path / "converted"
    tensors, calls = shard._ShardConverter.tensors, []

    def tensors_then_sigint(self, job):
        calls.append(job.name)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C: KeyboardInterrupt in the main thread
        return tensors(self, job)

    monkeypatch.setattr(shard._ShardConverter, "tensors", tensors_then_sigint)
    before = tree_digest(tiny_ckpt)
    rc, _, err = run_tool("convert", ["--src", tiny_ckpt, "--dst", dst, "--recipe", MIRROR, "--no_progress",
                                      "--workers", "1"])
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == INTERRUPTED and lines == ["modelopt-k3-convert: interrupted (SIGINT); temporary data removed"], err
    assert temp_leftovers(dst) == [] and tree_digest(tiny_ckpt) == before


@pytest.mark.slow
def test_hf_ptq_sigint_during_export_is_one_line_exit_130_and_leaves_nothing(tiny_ckpt, tmp_path, run_tool,
                                                                             monkeypatch) -> None:
    from modelopt_k3.export import writer

    out = tmp_path / "export"
    add, sent = writer.ShardWriter.add, []

    def add_then_sigint(self, name, tensor):
        add(self, name, tensor)
        if not sent:
            sent.append(name)
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(writer.ShardWriter, "add", add_then_sigint)
    rc, _, err = run_tool("ptq", _ptq_args(tiny_ckpt, out))
    assert sent and rc == INTERRUPTED and "modelopt-k3-ptq: interrupted (SIGINT); temporary data removed" in err
    assert "Traceback" not in err and not out.exists() and temp_leftovers(out) == []


def test_sigterm_right_after_the_owner_record_leaves_neither(tmp_path, monkeypatch) -> None:
    """The window the red team hit: the staging directory's owner record written, the directory not yet."""
    from modelopt_k3.cli._common import Terminated, sigterm_unwinds
    from modelopt_k3.export import staging

    start = staging.Heartbeat.start

    def start_then_sigterm(self):
        start(self)
        signal.raise_signal(signal.SIGTERM)
        return self

    monkeypatch.setattr(staging.Heartbeat, "start", start_then_sigterm)
    export_dir = tmp_path / "export"
    with pytest.raises(Terminated), sigterm_unwinds():
        staging.StagingDir(export_dir, "tmp").mkdir()
    assert list(tmp_path.iterdir()) == []


def test_overwrite_replaces_only_a_checkpoint_directory(tiny_ckpt, tmp_path, run_tool) -> None:
    """--overwrite deletes the old export once the new one is complete: never a directory that is not a
    checkpoint (a home directory given by mistake)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    t0 = time.perf_counter()
    rc, _, err = run_tool("ptq", _ptq_args(tiny_ckpt, home, "--overwrite"))
    assert time.perf_counter() - t0 < 5.0
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "is not a checkpoint" in lines[0], err
    assert [p.name for p in home.iterdir()] == ["thesis.tex"] and temp_leftovers(home) == []
