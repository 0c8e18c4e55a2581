"""Destinations and arguments that would fail late or destroy data: refused by the argument parser or the
preflight before any weight is read (in seconds), by the converter before it writes; stale temporary
data and locks of dead runs are recovered, those of live runs kept.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from faults.helpers import MIRROR, SMALL, temp_leftovers, tree_digest
from modelopt_k3.checkpoint import CheckpointReader
from modelopt_k3.convert import COMPLETE_MARKER, STATE_DIR, ConvertError, convert_checkpoint
from modelopt_k3.export.staging import OWNER_SUFFIX, sweep_stale
from modelopt_k3.files.locks import STALE_AFTER_ENV, Owner, write_record
from modelopt_k3.files.paths import DestinationError

PREFLIGHT_BUDGET_S = 5.0


@pytest.fixture
def no_weight_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self, key, *args):
        raise AssertionError(f"tensor {key} was read before the refusal")

    monkeypatch.setattr(CheckpointReader, "get", refuse)
    monkeypatch.setattr(CheckpointReader, "get_rows", refuse)


def _one_line(err: str, prog: str = "modelopt-k3-ptq") -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and "Traceback" not in err, err
    return lines[0]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# --------------------------------------------------------------------------- the source is never written


def _layouts(tmp_path: Path, copy_ckpt) -> dict[str, tuple[Path, Path]]:
    """(source, destination) pairs where writing the destination would overwrite or remove the source."""
    src = copy_ckpt()
    link = tmp_path / "link-to-source"
    link.symlink_to(src)
    return {
        "same directory": (src, src),
        "destination contains the source": (src, src.parent),
        "destination inside the source": (src, src / "export"),
        "destination is a symlink to the source": (src, link),
        "source through a symlink": (link, src),
    }


@pytest.mark.parametrize("layout", ["same directory", "destination contains the source", "destination inside the "
                                    "source", "destination is a symlink to the source", "source through a symlink"])
def test_hf_ptq_never_writes_over_the_source(layout, tmp_path, copy_ckpt, run_tool, no_weight_reads) -> None:
    src, dst = _layouts(tmp_path, copy_ckpt)[layout]
    before = tree_digest(src)
    t0 = time.perf_counter()
    rc, _, err = run_tool("ptq", ["--pyt_ckpt_path", src, "--trust_remote_code", "--export_path", dst, "--overwrite",
                                  *SMALL])
    assert time.perf_counter() - t0 < PREFLIGHT_BUDGET_S
    line = _one_line(err)
    assert rc == 2 and re.search(r"--export_path .* (is|contains|lies inside) the source checkpoint", line), line
    assert tree_digest(src) == before and not (src / "export").exists()


@pytest.mark.parametrize("layout", ["same directory", "destination contains the source", "destination inside the "
                                    "source", "destination is a symlink to the source", "source through a symlink"])
def test_converter_never_writes_over_the_source(layout, tmp_path, copy_ckpt, run_tool) -> None:
    src, dst = _layouts(tmp_path, copy_ckpt)[layout]
    before = tree_digest(src)
    rc, _, err = run_tool("convert", ["--src", src, "--dst", dst, "--recipe", MIRROR, "--overwrite", "--no_progress"])
    assert rc == 2 and "the source checkpoint" in _one_line(err, "modelopt-k3-convert")
    assert tree_digest(src) == before and not (src / "export").exists()


def test_export_checkpoint_refuses_the_source_directory_too(tiny_ckpt: Path) -> None:
    """The Python API: export_checkpoint checks before it opens the staging directory."""
    from types import SimpleNamespace

    from modelopt_k3 import export_checkpoint

    load = SimpleNamespace(checkpoint=tiny_ckpt)
    model = SimpleNamespace(modelopt_k3=load, modelopt_k3_quant=SimpleNamespace(load=load))
    with pytest.raises(DestinationError, match="is the source checkpoint"):
        export_checkpoint(model, tiny_ckpt, overwrite=True)


# --------------------------------------------------------------------------- preflight


def _unwritable(tmp_path: Path) -> Path:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    return blocker / "export"


PREFLIGHT = {
    "export path exists": (lambda tmp: ["--export_path", _existing(tmp)], r"--export_path .* exists and is not empty; "
                           r"pass --overwrite"),
    "export path not writable": (lambda tmp: ["--export_path", _unwritable(tmp)], r"cannot be created: .*a-file is "
                                 r"not a directory"),
    "compressed-tensors with KV cache": (lambda tmp: ["--export_format", "compressed-tensors", "--kv_cache_qformat",
                                                      "fp8"], r"--export_format compressed-tensors: .*kv_cache=fp8"),
    "compressed-tensors with mixed formats": (lambda tmp: ["--export_format", "compressed-tensors", "--recipe", MIRROR],
                                              r"compressed-tensors: .*\['FP8_PB_WO', 'NVFP4'\].*--export_format modelopt"),
    "dataset missing": (lambda tmp: ["--dataset", str(tmp / "calib.jsonl")], r"--dataset .*calib\.jsonl: calibration "
                        r"file .* does not exist"),
    "dataset empty": (lambda tmp: ["--dataset", _empty(tmp)], r"--dataset .*empty\.txt: .* holds no text"),
    "remote code not trusted": (lambda tmp: ["--no-trust"], r"ships its own modeling code; pass --trust_remote_code"),
}


def _existing(tmp: Path) -> str:
    (tmp / "taken").mkdir()
    (tmp / "taken" / "model.safetensors").write_bytes(b"someone's checkpoint")
    return str(tmp / "taken")


def _empty(tmp: Path) -> str:
    (tmp / "empty.txt").write_text("\n\n")
    return str(tmp / "empty.txt")


@pytest.mark.parametrize("case", list(PREFLIGHT))
def test_preflight_refuses_in_seconds_before_any_weight_is_read(case, tiny_ckpt, tmp_path, run_tool,
                                                                no_weight_reads) -> None:
    extra = [str(a) for a in PREFLIGHT[case][0](tmp_path)]
    trust = [] if "--no-trust" in extra else ["--trust_remote_code"]
    extra = [a for a in extra if a != "--no-trust"]
    if "--export_path" not in extra:
        extra += ["--export_path", str(tmp_path / "export")]
    before = tree_digest(tiny_ckpt)
    t0 = time.perf_counter()
    rc, _, err = run_tool("ptq", ["--pyt_ckpt_path", tiny_ckpt, *trust, *SMALL, *extra])
    elapsed = time.perf_counter() - t0
    assert rc == 2 and re.search(PREFLIGHT[case][1], _one_line(err)), err
    assert elapsed < PREFLIGHT_BUDGET_S, f"{case}: refused after {elapsed:.1f}s"
    assert tree_digest(tiny_ckpt) == before and not (tmp_path / "export").exists()


@pytest.mark.parametrize("flag", ["--calib_size", "--batch_size", "--calib_seq", "--max_shard_size_mb", "--ep_degree"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_argument_ranges_are_checked_by_the_parser(flag, value, capsys) -> None:
    from modelopt_k3.cli.hf_ptq import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: {value} is out of range: must be >= 1" in capsys.readouterr().err


def test_eval_kl_may_be_zero_but_not_negative(capsys) -> None:
    from modelopt_k3.cli.hf_ptq import build_parser

    assert build_parser().parse_args(["--eval_kl", "0"]).eval_kl == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--eval_kl", "-1"])
    assert "argument --eval_kl: -1 is out of range: must be >= 0" in capsys.readouterr().err


def test_debug_keeps_the_traceback(tiny_ckpt, tmp_path, run_tool) -> None:
    argv = ["--pyt_ckpt_path", tiny_ckpt, "--trust_remote_code", "--export_path", tiny_ckpt, *SMALL]
    rc, _, err = run_tool("ptq", [*argv, "--debug"])
    assert rc == 2 and "Traceback (most recent call last)" in err and "DestinationError" in err
    assert err.rstrip().splitlines()[-1].startswith("modelopt-k3-ptq: error: --export_path")


def test_a_check_added_to_the_preflight_list_sees_the_context(tiny_ckpt, tmp_path, run_tool, no_weight_reads,
                                                             monkeypatch) -> None:
    from modelopt_k3.run import preflight

    seen = []

    def _check(ctx: preflight.PreflightContext) -> None:
        seen.append((ctx.checkpoint, ctx.export_path, ctx.recipe.name, ctx.config.qformat))
        raise preflight.PreflightError("test refusal; do something else")

    names = [c.name for c in preflight.CHECKS]
    at = names.index("export format") + 1
    monkeypatch.setattr(preflight, "CHECKS", (*preflight.CHECKS[:at], preflight.PreflightCheck("test", _check),
                                              *preflight.CHECKS[at:]))
    rc, _, err = run_tool("ptq", ["--pyt_ckpt_path", tiny_ckpt, "--trust_remote_code", "--export_path",
                                  tmp_path / "out", *SMALL])
    assert rc == 2 and "test refusal; do something else" in _one_line(err)
    assert seen == [(tiny_ckpt, tmp_path / "out", "presets/nvfp4", "nvfp4")]


# --------------------------------------------------------------------------- temporary data of other runs


def _staging(export: Path, kind: str, owner: Owner | None, age_s: float = 0.0) -> Path:
    path = export.parent / f".{export.name}.{kind}-{os.urandom(6).hex()}"
    path.mkdir(parents=True)
    (path / "model-00001-of-00001.safetensors").write_bytes(b"x" * 100)
    if owner is not None:
        record = path.with_name(path.name + OWNER_SUFFIX)
        write_record(record, owner)
        if age_s:
            os.utime(record, (time.time() - age_s, time.time() - age_s))
    return path


def test_sweep_removes_only_what_dead_runs_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STALE_AFTER_ENV, "60")
    export = tmp_path / "export"
    me = Owner.this_process()
    dead = _staging(export, "tmp", Owner(_dead_pid(), me.host, me.boot_id, "1", time.time()))
    reused = _staging(export, "tmp", Owner(os.getppid(), me.host, me.boot_id, "1", time.time()))  # pid reused
    rebooted = _staging(export, "tmp", Owner(me.pid, me.host, "another-boot", me.start_ticks, time.time()))
    silent_host = _staging(export, "tmp", Owner(1, "other-host", None, None, time.time()), age_s=3600)
    live = _staging(export, "tmp", me)
    live_host = _staging(export, "tmp", Owner(1, "other-host", None, None, time.time()))
    unknown = _staging(export, "tmp", None)
    other_export = _staging(tmp_path / "export2", "tmp", Owner(_dead_pid(), me.host, me.boot_id, "1", time.time()))
    notes = sweep_stale(export)
    for gone in (dead, reused, rebooted, silent_host):
        assert not gone.exists() and not gone.with_name(gone.name + OWNER_SUFFIX).exists()
        assert any(f"removed {gone} left by a dead run" in n for n in notes), notes
    for kept in (live, live_host, unknown, other_export):
        assert kept.exists()
    assert any(f"kept {live}: its run may still be writing it" in n for n in notes)
    assert any(f"kept {unknown}: it has no owner record" in n for n in notes)


def test_sweep_puts_back_an_old_export_a_dead_run_moved_aside(tmp_path: Path) -> None:
    export = tmp_path / "export"
    me = Owner.this_process()
    aside = _staging(export, "old", Owner(_dead_pid(), me.host, me.boot_id, "1", time.time()))
    notes = sweep_stale(export)
    assert (export / "model-00001-of-00001.safetensors").exists() and not aside.exists()
    assert notes == [f"restored {export} from {aside}: the run replacing it died " + notes[0].split("died ", 1)[1]]


def test_preflight_refuses_while_another_live_run_exports_to_the_path(tiny_ckpt, tmp_path, run_tool) -> None:
    export = tmp_path / "export"
    live = _staging(export, "tmp", Owner.this_process())
    rc, _, err = run_tool("ptq", ["--pyt_ckpt_path", tiny_ckpt, "--trust_remote_code", "--export_path", export,
                                  *SMALL])
    assert rc == 2 and f"another run is exporting to {export}" in _one_line(err) and live.exists()


# --------------------------------------------------------------------------- converter locks


def _lock(dst: Path, rank: int, owner: Owner, *, fingerprint: str, world_size: int = 1, age_s: float = 0) -> Path:
    path = dst / STATE_DIR / "locks" / f"rank-{rank:05d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_record(path, owner, {"rank": rank, "world_size": world_size, "fingerprint": fingerprint})
    if age_s:
        os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_converter_recovers_locks_of_dead_owners_saying_so(tiny_ckpt, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(STALE_AFTER_ENV, "60")
    dst = tmp_path / "converted"
    me = Owner.this_process()
    _lock(dst, 0, Owner(_dead_pid(), me.host, me.boot_id, "1", time.time()), fingerprint="f")
    _lock(dst, 1, Owner(7, "node-b", None, None, time.time()), fingerprint="f", world_size=2, age_s=3600)
    report = convert_checkpoint(tiny_ckpt, dst, MIRROR)
    assert report.complete and (dst / COMPLETE_MARKER).exists() and temp_leftovers(dst) == []
    notes = "\n".join(report.notes)
    assert re.search(r"removed the stale lock of rank 0 \(pid \d+ on .*no longer runs", notes), notes
    assert "removed the stale lock of rank 1 (pid 7 on node-b" in notes and "no heartbeat from node-b" in notes


def test_converter_refuses_a_destination_held_by_a_live_run_on_another_host(tiny_ckpt, tmp_path) -> None:
    dst = tmp_path / "converted"
    held = _lock(dst, 3, Owner(7, "node-b", None, None, time.time()), fingerprint="another job", world_size=4)
    with pytest.raises(ConvertError, match=r"being written by another conversion \(pid 7 on node-b, .*rank 3 of 4; "
                                           rf"node-b is another host and its heartbeat is \d+ s old.*remove "
                                           rf"{re.escape(str(held))} if that run is dead"):
        convert_checkpoint(tiny_ckpt, dst, MIRROR, overwrite=True)  # --overwrite does not override a live run
    assert held.exists() and not (dst / COMPLETE_MARKER).exists()
