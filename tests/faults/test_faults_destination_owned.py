"""A booby-trapped destination: the converter writes only what it owns and never through what was planted.

Each case asserts the exit code, the one line, the time to the refusal, the source byte-identical, and what is
left in the destination (nothing a rerun would trust, nothing of the user's removed).
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from faults.helpers import MIRROR, temp_leftovers, tree_digest
from modelopt_k3.convert import COMPLETE_MARKER, STATE_DIR, convert_checkpoint
from modelopt_k3.export.writer import PlannedShard, PlannedTensor
from modelopt_k3.files.paths import staging_path

INDEX = "model.safetensors.index.json"
REFUSAL_BUDGET_S = 5.0


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("modelopt-k3-convert: error: ") and "Traceback" not in err, err
    return lines[0]


def _shards(ckpt: Path) -> list[str]:
    return sorted(set(json.loads((ckpt / INDEX).read_text())["weight_map"].values()))


def _convert(run_tool, src: Path, dst: Path, *extra) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    rc, _, err = run_tool("convert", ["--src", src, "--dst", dst, "--recipe", MIRROR, "--no_progress", *extra])
    return rc, err, time.perf_counter() - t0


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def src(copy_ckpt) -> Path:
    return copy_ckpt()


def test_a_symlink_at_the_old_staging_name_never_reaches_the_source(src, tmp_path, run_tool) -> None:
    """The red team's attack: an empty state directory and a link where the converter used to stage shard 2."""
    before = tree_digest(src)
    dst = tmp_path / "out"
    (dst / STATE_DIR).mkdir(parents=True)
    victim = _shards(src)[1]
    planted = dst / f".{victim}.partial"
    planted.symlink_to(src / victim)
    rc, err, seconds = _convert(run_tool, src, dst)  # an empty state directory is no record of ours
    assert rc == 2 and seconds < REFUSAL_BUDGET_S
    assert re.search(r"is not empty and holds no modelopt_k3 conversion record", _one_line(err))
    rc, err, _ = _convert(run_tool, src, dst, "--overwrite")
    assert rc == 0, err
    assert tree_digest(src) == before
    for file in _shards(src):
        assert (dst / file).is_file() and not (dst / file).is_symlink(), file
    assert planted.is_symlink() and os.readlink(planted) == str(src / victim)  # not ours: left, never followed
    assert temp_leftovers(dst) == [str(planted)]


def test_a_staging_file_is_created_new_or_not_at_all(tmp_path: Path) -> None:
    """Whatever sits at a staging name (a file, a symlink to the source) refuses the create: nothing is
    opened, truncated or followed."""
    import torch

    target = tmp_path / "source-shard"
    target.write_bytes(b"source bytes")
    planned = [PlannedTensor("x", torch.float32, (2,))]
    for planted in (tmp_path / "link", tmp_path / "file"):
        if planted.name == "link":
            planted.symlink_to(target)
        else:
            planted.write_bytes(b"user data")
        with pytest.raises(FileExistsError):
            PlannedShard(planted, planned)
    assert target.read_bytes() == b"source bytes" and (tmp_path / "file").read_bytes() == b"user data"
    a, b = staging_path(tmp_path / "m.safetensors"), staging_path(tmp_path / "m.safetensors")
    assert a != b and re.fullmatch(r"\.m\.safetensors\.[0-9a-f]{32}\.partial", a.name)


@pytest.mark.parametrize("where", [STATE_DIR, f"{STATE_DIR}/shards", f"{STATE_DIR}/locks"])
def test_a_state_directory_planted_as_a_symlink_is_refused(where, src, tmp_path, run_tool) -> None:
    before = tree_digest(src)
    dst = tmp_path / "out"
    (dst / where).parent.mkdir(parents=True, exist_ok=True)
    (dst / where).symlink_to(src, target_is_directory=True)
    rc, err, seconds = _convert(run_tool, src, dst, "--overwrite")
    assert rc == 2 and seconds < REFUSAL_BUDGET_S
    assert re.search(rf"{re.escape(where)} is a symlink; the converter keeps its state there", _one_line(err))
    assert tree_digest(src) == before and (dst / where).is_symlink()


def test_overwrite_removes_only_what_a_conversion_wrote(src, tmp_path, run_tool) -> None:
    """--overwrite writes among the user's files and removes only shards an earlier conversion recorded."""
    dst = tmp_path / "out"
    assert _convert(run_tool, src, dst)[0] == 0
    job_path = dst / STATE_DIR / "job.json"
    job = json.loads(job_path.read_text())
    job["shards"].append("model-99999-of-99999.safetensors")  # as if the earlier job had written it
    job["shards"].append("model-99998-of-99999.safetensors")  # ... and the user put a directory there since
    job_path.write_text(json.dumps(job))
    (dst / "model-99999-of-99999.safetensors").write_bytes(b"an earlier conversion's shard")
    (dst / "model-99998-of-99999.safetensors").mkdir()
    (dst / "model-99998-of-99999.safetensors" / "kept.txt").write_text("mine")
    (dst / "notes.txt").write_text("mine")
    (dst / "other.safetensors").write_bytes(b"not written by a conversion")
    (dst / COMPLETE_MARKER).unlink()
    rc, err, _ = _convert(run_tool, src, dst, "--overwrite")
    assert rc == 0, err
    assert not (dst / "model-99999-of-99999.safetensors").exists()
    assert (dst / "notes.txt").read_text() == "mine" and (dst / "other.safetensors").exists()
    assert (dst / "model-99998-of-99999.safetensors" / "kept.txt").read_text() == "mine"  # not a file: not ours


def test_a_non_empty_destination_without_our_record_needs_overwrite(src, tmp_path, run_tool) -> None:
    dst = tmp_path / "out"
    (dst / STATE_DIR / "shards").mkdir(parents=True)
    (dst / STATE_DIR / "job.json").write_text("[]")  # not a record of ours
    (dst / "weights.bin").write_bytes(b"x")
    rc, err, seconds = _convert(run_tool, src, dst)
    assert rc == 2 and seconds < REFUSAL_BUDGET_S and "--overwrite" in _one_line(err)
    assert sorted(p.name for p in dst.iterdir()) == [STATE_DIR, "weights.bin"]
    only_state = tmp_path / "only-state"
    (only_state / STATE_DIR / "locks").mkdir(parents=True)  # what a run killed before its record leaves
    assert _convert(run_tool, src, only_state)[0] == 0


def test_a_rerun_sweeps_the_temporary_files_a_killed_finalize_left(src, tmp_path) -> None:
    dst = tmp_path / "out"
    convert_checkpoint(src, dst, MIRROR, rank=0, world_size=2)  # half of the shards
    dead = _dead_pid()
    left = [dst / f".config.json.tmp-{dead}-0123abcd", dst / STATE_DIR / "shards" / f".x.json.tmp-{dead}-4567"]
    for path in left:
        path.write_text("{")
    report = convert_checkpoint(src, dst, MIRROR, rank=1, world_size=2)
    assert report.complete and not any(p.exists() for p in left)
    assert temp_leftovers(dst) == []


def test_a_destination_under_a_file_is_one_line(src, tmp_path, run_tool) -> None:
    (tmp_path / "file").write_text("x")
    before = tree_digest(src)
    rc, err, seconds = _convert(run_tool, src, tmp_path / "file" / "out")
    assert rc == 2 and seconds < REFUSAL_BUDGET_S
    assert re.search(r"cannot be created: .*file is not a directory", _one_line(err))
    assert tree_digest(src) == before


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_disk_full_or_read_only_mid_shard_is_one_line_and_leaves_nothing(code, src, tmp_path, run_tool,
                                                                          monkeypatch) -> None:
    """The write that fails (disk full, a filesystem remounted read-only) ends the run in one line, exit 2;
    the shard being written is removed and the lock released."""
    from modelopt_k3.export import writer

    calls = [0]
    real = writer.pwrite_all

    def fails_on_the_third(fd, data, offset):
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(code, os.strerror(code))
        return real(fd, data, offset)

    monkeypatch.setattr(writer, "pwrite_all", fails_on_the_third)
    before = tree_digest(src)
    dst = tmp_path / "out"
    rc, err, _ = _convert(run_tool, src, dst, "--workers", "1")
    assert rc == 2 and os.strerror(code) in _one_line(err)
    assert tree_digest(src) == before and temp_leftovers(dst) == []
    assert not (dst / COMPLETE_MARKER).exists() and not (dst / INDEX).exists()


def test_the_sweep_keeps_a_live_process_temporaries_and_removes_dead_or_stale_ones(tmp_path, monkeypatch) -> None:
    """``sweep_tmp_files``: a fresh temporary of a live process (the parent of this one: another pid that
    runs) stays; a dead process's goes at once; a live one's goes only past the stale limit."""
    from modelopt_k3.convert.state import sweep_tmp_files
    from modelopt_k3.files.locks import STALE_AFTER_ENV

    monkeypatch.setenv(STALE_AFTER_ENV, "600")
    live, dead = os.getppid(), _dead_pid()
    fresh_live = tmp_path / f".config.json.tmp-{live}-0a1b"
    stale_live = tmp_path / f".hf_quant_config.json.tmp-{live}-2c3d"
    fresh_dead = tmp_path / f".x.json.tmp-{dead}-4e5f"
    mine = tmp_path / f".y.json.tmp-{os.getpid()}-6a7b"
    other = tmp_path / "config.json"
    for path in (fresh_live, stale_live, fresh_dead, mine, other):
        path.write_text("{")
    old = time.time() - 3600
    os.utime(stale_live, (old, old))
    assert sorted(sweep_tmp_files(tmp_path)) == sorted([stale_live, fresh_dead])
    assert fresh_live.exists() and mine.exists() and other.exists()
    assert not stale_live.exists() and not fresh_dead.exists()
