"""A converter killed outright (SIGKILL: no handler runs, nothing is cleaned up) in the middle of a shard.

What a reader of the destination may rely on, however the converter stages its work: a file under a name
that the complete output has is never a half-written one; it is absent or already holds its final bytes.
The rerun then completes the same output, byte for byte.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from faults.helpers import MIRROR, run_driver
from modelopt_k3.convert import convert_checkpoint

pytestmark = pytest.mark.slow  # two conversions and one killed converter process (no torchrun, no gloo)


def _final_files(out: Path) -> dict[str, bytes]:
    """The output's files by name; hidden ones (the converter's own state and staging) are not output."""
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and not p.name.startswith(".")}


def test_a_killed_converter_leaves_nothing_half_written_under_a_final_name(tiny_ckpt: Path, tmp_path: Path):
    want = _final_files(convert_checkpoint(tiny_ckpt, tmp_path / "uninterrupted", MIRROR, progress=False).dst)
    assert sum(name.endswith(".safetensors") for name in want) >= 2
    dst = tmp_path / "killed"
    argv = ["--src", tiny_ckpt, "--dst", dst, "--recipe", MIRROR, "--no_progress", "--workers", "1"]
    launcher, codes, _, output = run_driver(tmp_path, "convert", argv, fault="kill@convert")  # at its 2nd module
    assert launcher == -signal.SIGKILL and codes[0] is None, output
    left = _final_files(dst) if dst.is_dir() else {}
    assert set(left) <= set(want), sorted(set(left) - set(want))
    assert [name for name, data in left.items() if data != want[name]] == []
    assert convert_checkpoint(tiny_ckpt, dst, MIRROR, progress=False).complete  # the rerun completes it
    assert _final_files(dst) == want
