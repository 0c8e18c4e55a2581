"""Ranks killed or signalled during calibration and export, and a converter stopped or raced mid-run:
every rank exits non-zero, at most one line per group of ranks, the source is untouched, nothing
appears at the destination, and temporary data is removed (on SIGTERM) or swept by the next run
(after ``kill -9``).

Real torchrun where its behaviour is the point (it SIGTERMs the survivors when a rank dies); else
in-process or forkserver ranks (``tests/_mp.py``), which start in a fraction of the time.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
from _mp import _CTX, run_ranks

from faults import _driver
from faults.helpers import LAYERS, MIRROR, SMALL, rank_results, run_driver, temp_leftovers, tree_digest
from modelopt_k3.convert import ConvertError, convert_checkpoint

pytestmark = pytest.mark.multiprocess
TERMINATED = 128 + signal.SIGTERM
REFUSED = 2


def _errors(text: str, prog: str = "modelopt-k3-ptq") -> list[str]:
    return [line for line in text.splitlines() if line.startswith(f"{prog}: error")]


def _ptq_args(src: Path, out: Path, *extra) -> list[str]:
    return ["--pyt_ckpt_path", str(src), "--trust_remote_code", "--export_path", str(out), *SMALL, *extra]


def _ranks(tmp_path: Path, argv: list[str], fault: str) -> tuple[dict[int, int | None], dict[int, str]]:
    """Two forkserver ranks of hf_ptq with ``fault``: each rank's exit code (None: killed) and stderr."""
    err_dir = tmp_path / "rank-stderr"
    err_dir.mkdir()
    results = run_ranks(2, _driver.in_rank, "ptq", argv, fault, str(err_dir), timeout=240,
                        env={"MODELOPT_K3_DIST_TIMEOUT": "60"})
    codes = {r.rank: (r.value if r.exitcode == 0 else None) for r in results}
    errs = {r: (err_dir / f"rank{r}.err").read_text() if (err_dir / f"rank{r}.err").exists() else "" for r in (0, 1)}
    return codes, errs


def test_sigterm_during_export_removes_the_staging_directory(tiny_ckpt, tmp_path, run_tool, monkeypatch) -> None:
    from modelopt_k3.export import writer

    before = tree_digest(tiny_ckpt)
    out = tmp_path / "export"
    add, sent = writer.ShardWriter.add, []

    def add_then_sigterm(self, name, tensor):
        add(self, name, tensor)
        if not sent:
            sent.append(name)
            signal.raise_signal(signal.SIGTERM)  # to this process: run_cli's handler unwinds the export

    monkeypatch.setattr(writer.ShardWriter, "add", add_then_sigterm)
    rc, _, err = run_tool("ptq", _ptq_args(tiny_ckpt, out))
    assert sent and rc == TERMINATED and "terminated (SIGTERM); temporary data removed" in err
    assert not out.exists() and temp_leftovers(out) == []
    assert tree_digest(tiny_ckpt) == before


def test_kill_during_export_leaves_staging_that_the_next_run_removes(tiny_ckpt, tmp_path, run_tool, caplog) -> None:
    out = tmp_path / "export"
    launcher, codes, _, output = run_driver(tmp_path, "ptq", _ptq_args(tiny_ckpt, out), fault="kill@export")
    assert launcher == -signal.SIGKILL and codes[0] is None, output
    left = temp_leftovers(out)
    # .export.tmp-<hex>/, its owner record, and the preflight's .export.lock: all of a dead owner
    assert not out.exists() and len(left) == 3 and any(p.endswith(".export.lock") for p in left), left
    # The next run to the same path removes it first (in its preflight), saying why; here it then
    # stops at its missing dataset.
    rc, _, err = run_tool("ptq", _ptq_args(tiny_ckpt, out, "--dataset", "/missing/calib.txt"))
    assert rc == REFUSED and "--dataset /missing/calib.txt" in err
    assert re.search(r"removed .*\.export\.tmp-[0-9a-f]{12} left by a dead run \(pid \d+ on .*no longer runs",
                     caplog.text), caplog.text
    assert temp_leftovers(out) == [] and not out.exists()


def test_torchrun_kill_one_rank_during_export(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Rank 1 is killed while writing; torchrun SIGTERMs rank 0, which removes the staging directory."""
    before = tree_digest(tiny_ckpt)
    out = tmp_path / "export"
    launcher, codes, errs, output = run_driver(
        tmp_path, "ptq", _ptq_args(tiny_ckpt, out), fault="kill@export:rank1", nproc=2)
    assert launcher != 0 and codes[1] is None, output  # rank 1 died outright
    assert codes[0] in (REFUSED, TERMINATED), (codes, errs[0])  # a failed collective, or torchrun's SIGTERM
    assert len(_errors(errs[0])) <= 1 and "Traceback" not in errs[0], errs[0]
    assert not out.exists() and temp_leftovers(out) == []
    assert tree_digest(tiny_ckpt) == before


def test_torchrun_kill_one_rank_as_the_staging_directory_appears(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Rank 1 is killed right after rank 0 made the staging directory, before its path reached rank 1: rank 0
    leaves nothing behind, and says "temporary data removed" only if it was (was: said so and left it)."""
    out = tmp_path / "export"
    launcher, codes, errs, output = run_driver(
        tmp_path, "ptq", _ptq_args(tiny_ckpt, out), fault="kill@staging:rank1", nproc=2)
    assert launcher != 0 and codes[1] is None, output
    assert codes[0] in (REFUSED, TERMINATED), (codes, errs[0])
    assert len(_errors(errs[0])) <= 1 and "Traceback" not in errs[0], errs[0]
    assert not out.exists() and temp_leftovers(out) == [], (temp_leftovers(out), errs[0])
    said = [line for line in errs[0].splitlines() if line.startswith("modelopt-k3-ptq: ")]
    assert len(said) == 1 and (said[0].endswith("temporary data removed") or ": error: " in said[0]), errs[0]


def test_kill_one_rank_as_the_staging_directory_appears_without_a_launcher(tiny_ckpt: Path, tmp_path: Path) -> None:
    """The same with no torchrun to SIGTERM rank 0: its broadcast of the staging path fails instead; it refuses in
    one line and removes the directory it made."""
    out = tmp_path / "export"
    codes, errs = _ranks(tmp_path, _ptq_args(tiny_ckpt, out), "kill@staging:rank1")
    assert codes == {0: REFUSED, 1: None}, (codes, errs)
    assert len(_errors(errs[0])) == 1 and "Traceback" not in errs[0], errs[0]
    assert not out.exists() and temp_leftovers(out) == [], (temp_leftovers(out), errs[0])


def test_kill_one_rank_during_calibration(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "export"
    codes, errs = _ranks(tmp_path, _ptq_args(tiny_ckpt, out), "kill@calib:rank1")
    assert codes == {0: REFUSED, 1: None}, (codes, errs)
    (line,) = _errors(errs[0])
    assert "calibration forward" in line and "Traceback" not in errs[0]
    assert not out.exists() and temp_leftovers(out) == []


def test_refusal_seen_by_one_rank_is_one_line_and_every_rank_exits_2(copy_ckpt, tiny_ckpt, tmp_path) -> None:
    """A NaN scale in an expert only rank 1 reads (experts 4-7 at EP 2): both ranks exit 2; rank 0 prints
    the one line naming rank 1, the tensor and the count; rank 1 prints nothing."""
    from safetensors import safe_open

    key = f"{LAYERS}.2.block_sparse_moe.experts.6.w2.weight_scale"
    wmap = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(tiny_ckpt / wmap[key], framework="pt") as f:
        bad = f.get_tensor(key).clone()
    bad[0, 0] = 255
    src = copy_ckpt(replace={key: bad})
    before = tree_digest(src)
    out = tmp_path / "export"
    codes, errs = _ranks(tmp_path, _ptq_args(src, out), "")
    assert codes == {0: REFUSED, 1: REFUSED}, (codes, errs)
    (line,) = _errors(errs[0])
    assert "load checkpoint failed on rank 1: NonFiniteError:" in line and f"{key} (1 E8M0 scale byte 255" in line
    assert _errors(errs[1]) == [] and "Traceback" not in errs[0] + errs[1]
    assert tree_digest(src) == before and not out.exists() and temp_leftovers(out) == []


def test_converter_sigterm_removes_its_partial_shard_and_releases_its_lock(tiny_ckpt, tmp_path, run_tool,
                                                                           monkeypatch) -> None:
    from modelopt_k3.convert import shard

    dst = tmp_path / "converted"
    tensors, calls = shard._ShardConverter.tensors, []

    def tensors_then_sigterm(self, job):
        calls.append(job.name)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGTERM)
        return tensors(self, job)

    monkeypatch.setattr(shard._ShardConverter, "tensors", tensors_then_sigterm)
    rc, _, _ = run_tool("convert", ["--src", tiny_ckpt, "--dst", dst, "--recipe", MIRROR, "--no_progress",
                                    "--workers", "1"])
    assert rc == TERMINATED and len(calls) == 2
    assert temp_leftovers(dst) == [] and not (dst / ".modelopt_k3_complete").exists()
    monkeypatch.undo()
    assert convert_checkpoint(tiny_ckpt, dst, MIRROR).complete  # resumes
    assert temp_leftovers(dst) == []


def test_converter_second_run_on_one_destination_is_refused_naming_the_holder(tiny_ckpt, tmp_path) -> None:
    dst, rc_dir = tmp_path / "converted", tmp_path / "holder"
    rc_dir.mkdir()
    argv = ["--src", str(tiny_ckpt), "--dst", str(dst), "--recipe", MIRROR, "--no_progress", "--workers", "1"]
    holder = _CTX.Process(target=_driver.stalled_convert, args=(argv, str(rc_dir)), daemon=True)
    holder.start()
    try:
        deadline = time.monotonic() + 120
        while not (rc_dir / "stalled").exists():
            assert holder.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(ConvertError, match=rf"rank 0 of {re.escape(str(dst))} is already being converted "
                                               rf"\(pid {holder.pid} on .*wait for it to end, or remove"):
            convert_checkpoint(tiny_ckpt, dst, MIRROR)
        with pytest.raises(ConvertError, match=rf"being written by another conversion \(pid {holder.pid} "):
            convert_checkpoint(tiny_ckpt, dst, MIRROR, rank=0, world_size=2)
    finally:
        holder.terminate()  # SIGTERM: its handler unwinds, removing the partial shard and the lock
        holder.join(60)
    assert rank_results(rc_dir, 1)[0] == {0: TERMINATED}
    assert temp_leftovers(dst) == []
    assert convert_checkpoint(tiny_ckpt, dst, MIRROR).complete  # the holder is gone: this run proceeds
