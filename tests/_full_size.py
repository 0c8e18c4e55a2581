"""What the full-size planner tests share: ``modelopt-k3-plan``'s JSON rows for a header-only layout on one 8 x 141
GiB (H200) node, and a checkpoint's stored tensor headers (a layout generator at tiny sizes must write the
stand-in's)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path


def plan_8_h200(layout: Path, *flags: str) -> dict[str, dict]:
    """Plan name -> its row (BF16-resident experts) of ``modelopt-k3-plan --world_size 8 --gpu_mem_gib 141``."""
    from modelopt_k3.cli import plan

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan.main(["--pyt_ckpt_path", str(layout), "--world_size", "8", "--gpu_mem_gib", "141", "--device", "cuda",
                   "--json", *flags])
    return {r["plan"]: r for r in json.loads(out.getvalue()) if r["experts"] == "bf16"}


def stored_headers(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every stored tensor's dtype and shape, by name (headers only)."""
    from modelopt_k3.checkpoint import CheckpointReader

    with CheckpointReader(path) as reader:
        return {name: (str(info.dtype), tuple(info.shape)) for name, info in reader.headers().items()}
