"""The streaming converter's figures, from ``benchmarks/bench_convert.py`` (maintained separately).

That script is run as it is, in a subprocess (``--no_write``: the suite keeps its figures in
``results.json`` and leaves ``benchmarks/results/convert.json`` to the script's own runs), and the
JSON summary it prints is turned into two figures: conversion throughput vs a plain copy of the
same shards (goal >= 0.6, raised from 0.5 by issue 12) and the conversion's peak memory over the largest shard (goal <= 3).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .common import Figure, summary

AREA = "convert"
SCRIPT = Path(__file__).resolve().parent / "bench_convert.py"
TIMEOUT_S = 420


def _printed_json(stdout: str) -> dict:
    """The last top-level JSON object the script printed (an indented block from ``{`` to ``}``)."""
    lines = stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if line == "{"]
    for start in reversed(starts):
        for end in range(start + 1, len(lines)):
            if lines[end] == "}":
                return json.loads("\n".join(lines[start : end + 1]))
    raise ValueError(f"{SCRIPT.name} printed no JSON summary; its output ends with:\n{stdout[-2000:]}")


def run(ctx):
    if not SCRIPT.exists():
        return [], {"skipped": f"{SCRIPT} does not exist"}
    repeats = max(2, min(3, ctx.repeats))
    cmd = [sys.executable, str(SCRIPT), "--workdir", str(ctx.workdir / "convert"), "--repeats", str(repeats),
           "--no_write"]
    if ctx.quick:
        cmd += ["--experts", "8", "--shard_mb", "32"]
    ctx.log(" ".join(cmd[1:]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=SCRIPT.parent.parent)
    if proc.returncode:
        raise RuntimeError(f"{SCRIPT.name} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    r = _printed_json(proc.stdout)
    copy_s, convert_s = r["copy_s"], r["convert_s"]
    paired = [c / v for c, v in zip(copy_s, convert_s)]
    figures = [
        Figure(
            name="convert/throughput", area=AREA, title="streaming convert_checkpoint vs plain copy of the shards",
            ours={"label": "convert_checkpoint (Kimi-K3 mirror recipe; fsync + sha256 per shard)", **summary(convert_s)},
            reference={"label": "read + write every shard in 64 MiB chunks", **summary(copy_s)},
            ratio=r["throughput_ratio"], ratio_range=(min(paired), max(paired)), target=0.6,
            target_text=">= 0.6 of copy throughput",
            bound="the converter reads every byte, casts the experts and writes with fsync and a sha256 per "
                  "shard; the plain copy only reads and writes",
            details={k: r.get(k) for k in ("copy_mib_per_s", "convert_mib_per_s", "notes")},
        ),
        Figure(
            name="convert/memory", area=AREA, title="streaming convert_checkpoint peak RSS over largest shard",
            ours={"label": "(peak - baseline) RSS / largest shard", "value": r["conversion_rss_over_largest_shard"],
                  "unit": "x"},
            reference={"label": "largest source shard", "value": 1.0, "unit": "x"},
            ratio=r["conversion_rss_over_largest_shard"], target=3.0, target_text="<= 3x largest shard",
            bound="one source shard read and one output shard written at a time, plus the expert casts",
            unit="x", higher_is_better=False,
            details={k: r.get(k) for k in ("baseline_rss_bytes", "peak_rss_bytes", "peak_rss_over_largest_shard",
                                           "memory_goal")},
        ),
    ]
    return figures, {"command": cmd[1:], "summary": r}
