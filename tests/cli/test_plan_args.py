"""``modelopt-k3-plan`` checks every argument before any work: a bad number, a path that is no checkpoint or a
recipe that does not exist is one line on stderr and exit 2, never a traceback or a table of zeros (issue 42)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from modelopt_k3.cli.plan import main as plan_main


@pytest.mark.parametrize("extra, said", [
    (["--world_size", "0"], "--world_size: 0 is out of range"),
    (["--world_size", "2", "--batch_size", "0"], "--batch_size: 0 is out of range"),
    (["--world_size", "2", "--calib_seq", "-5"], "--calib_seq: -5 is out of range"),
    (["--world_size", "2", "--gpu_mem_gib", "-1"], "--gpu_mem_gib: -1 is out of range"),
    (["--world_size", "2", "--gpu_mem_gib", "nan"], "--gpu_mem_gib: nan is out of range"),
    (["--world_size", "2", "--recipe", "no-such-recipe"], "recipe 'no-such-recipe' not found"),
    (["--world_size", "2", "--qformat", "bogus"], "recipe 'bogus' not found"),
])
def test_a_bad_argument_is_one_line_and_exit_2(tiny_ckpt, capsys, extra, said) -> None:
    with pytest.raises(SystemExit) as exit_info:
        rc = plan_main(["--pyt_ckpt_path", str(tiny_ckpt), *extra])
        raise SystemExit(rc)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and said in err[-1] and "Traceback" not in "\n".join(err)


@pytest.mark.parametrize("where", ["missing", "file"])
def test_a_path_that_is_no_checkpoint_is_one_line_and_exit_2(tiny_ckpt, tmp_path, where) -> None:
    path = tmp_path / "nothing" if where == "missing" else tiny_ckpt / "config.json"
    proc = subprocess.run([sys.executable, "-m", "modelopt_k3.cli.plan", "--pyt_ckpt_path", str(path), "--world_size",
                           "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"modelopt-k3-plan: error: {path} has no config.json; is it a "
                                                "checkpoint directory?"]
