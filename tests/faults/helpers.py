"""Helpers for the fault set (``tests/faults``): run the command line tools in-process or under torchrun, and check that a
failed run left the source untouched, nothing but a complete checkpoint at the destination, and no
temporary data anywhere.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

DRIVER = Path(__file__).with_name("_driver.py")
REPO = Path(__file__).resolve().parents[2]
MIRROR = "models/moonshotai/Kimi-K3/nvfp4_experts-fp8_pb_attention"
LAYERS = "language_model.model.layers"
# Small calibration: the faults under test do not depend on how much data there is.
SMALL = ["--calib_size", "2", "--batch_size", "2", "--calib_seq", "16", "--no_progress"]


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (hidden ones too), by relative name."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def temp_leftovers(*dirs: Path) -> list[str]:
    """Temporary data next to or inside ``dirs``: staging/aside dirs, owner records, partial shards, locks."""
    found = []
    for d in dirs:
        for where in (d.parent, d):
            if not where.is_dir():
                continue
            for p in where.iterdir():
                name = p.name
                if name.startswith(f".{d.name}.") or name.endswith((".partial", ".owner.json", ".spill")):
                    found.append(str(p))
        locks = d / ".modelopt_k3_convert" / "locks"
        if locks.is_dir():
            found += [str(p) for p in locks.iterdir()]
    return sorted(found)


def export_is_complete(out: Path) -> bool:
    index = out / "model.safetensors.index.json"
    if not index.is_file():
        return False
    import json

    files = set(json.loads(index.read_text())["weight_map"].values())
    return all((out / f).is_file() for f in files) and (out / "config.json").is_file()


def driver_command(tmp_path: Path, tool: str, argv: list[str], *, fault: str, nproc: int = 1
                   ) -> tuple[list[str], dict[str, str], Path]:
    """The command, environment and exit-code directory for one run of the fault driver."""
    from _mp import free_port

    rc_dir = tmp_path / f"rc-{tool}-{fault.replace('@', '-').replace(':', '-')}-{nproc}"
    rc_dir.mkdir()
    env = {**os.environ, "FAULT": fault, "RC_DIR": str(rc_dir), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)
    if nproc == 1:
        cmd = [sys.executable, str(DRIVER), tool, *map(str, argv)]
    else:  # torchrun keeps each rank's output apart (--redirects 3 into --log-dir)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(free_port()), "--log-dir", str(rc_dir / "logs"), "--redirects", "3",
               str(DRIVER), tool, *map(str, argv)]
    return cmd, env, rc_dir


def rank_results(rc_dir: Path, nproc: int) -> tuple[dict[int, int | None], dict[int, str]]:
    """Each rank's recorded exit code (None: killed before it could record one) and its stderr (torchrun)."""
    codes, errs = {}, {}
    for rank in range(nproc):
        path = rc_dir / f"rank{rank}.rc"
        codes[rank] = int(path.read_text()) if path.exists() else None
        logs = sorted((rc_dir / "logs").rglob(f"{rank}/stderr.log")) if (rc_dir / "logs").is_dir() else []
        errs[rank] = logs[-1].read_text() if logs else ""
    return codes, errs


def run_driver(tmp_path: Path, tool: str, argv: list[str], *, fault: str, nproc: int = 1, timeout: float = 300
               ) -> tuple[int, dict[int, int | None], dict[int, str], str]:
    """Run the driver to the end: (launcher exit code, each rank's exit code, each rank's stderr under
    torchrun, the launcher's combined output)."""
    cmd, env, rc_dir = driver_command(tmp_path, tool, argv, fault=fault, nproc=nproc)
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    codes, errs = rank_results(rc_dir, nproc)
    return proc.returncode, codes, errs, proc.stdout + proc.stderr
