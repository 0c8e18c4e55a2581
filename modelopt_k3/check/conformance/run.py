"""Run the engines' own loaders over exports and compare with ``modelopt-k3-check``'s verdicts.

Per (engine version, export) cell a driver runs in the engine's venv (``drivers/<engine>_k3.py``, a
subprocess with a timeout) and writes what it saw as JSON; this module turns that into an observed
verdict in the check's vocabulary:

* ``refuses``: the engine raised while building its model from the export's configs, in
  ``load_weights``, or in ``process_weights_after_loading``;
* ``loads but serves different numbers``: it loaded, but an export tensor landed in no parameter byte
  for byte, an engine parameter was never written, or a post-load scale differs from the export's;
* ``loads correctly``: none of those.

What the CPU run cannot observe (post-processing a kernel layout that needs a GPU, the first forward)
is recorded per cell, not guessed.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..report import DIFFERENT, LOADS, REFUSES
from .venv import EngineSpec, driver_stub, ensure_venv, installed_version, python_of

DRIVERS = Path(__file__).parent / "drivers"
CHECK_ENGINES = ("vllm", "sglang", "trtllm")
NOT_OBSERVABLE = {  # what no CPU run of these drivers sees, whatever the cell
    "vllm": ("any forward (every GEMM, attention and MoE kernel is CUDA)",),
    "sglang": ("any forward past the routed experts' kernel arguments (the kernels are CUDA)",),
}


def export_fingerprint(export: Path) -> str:
    """Names, sizes and mtimes of everything under ``export``: a driver must leave it unchanged."""
    h = hashlib.sha256()
    for p in sorted(export.rglob("*")):
        st = p.stat()
        h.update(f"{p.relative_to(export)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def run_driver(spec: EngineSpec, venv: Path, exports: list[Path], *, timeout: float,
               options: dict | None = None) -> list[dict]:
    """The driver's JSON for each export, in order. One engine process loads the exports in turn
    (importing the engine is most of a run); when it dies or times out, the exports it had not
    answered are each retried in a process of their own, so one bad cell cannot hide the others."""
    before = {e: export_fingerprint(e) for e in exports}
    results: dict[int, dict] = {}
    pending = list(range(len(exports)))
    batch = True
    while pending:
        group = pending if batch else pending[:1]
        answered = _driver_process(spec, venv, [exports[i] for i in group], timeout * len(group), options)
        for j, i in enumerate(group):
            if j in answered:
                results[i] = answered[j]
            elif not batch or len(group) == 1:
                results[i] = answered.get("failure", {"outcome": "driver crashed"})
        pending = [i for i in pending if i not in results]
        batch = False
    for i, e in enumerate(exports):
        if export_fingerprint(e) != before[e]:
            results[i]["export_modified"] = True
    return [results[i] for i in range(len(exports))]


def _driver_process(spec: EngineSpec, venv: Path, exports: list[Path], timeout: float, options) -> dict:
    with tempfile.TemporaryDirectory(prefix="k3conf-") as tmp:
        out = Path(tmp) / "results"
        out.mkdir()
        cmd = [str(python_of(venv)), str(DRIVERS / f"{spec.name}_k3.py"), "--exports", *map(str, exports),
               "--out_dir", str(out), "--options", json.dumps(options or {})]
        # The driver's own scratch (engine caches, HF modules) stays in the temporary directory; the GPU
        # driver stand-in (venv.driver_stub) is found through the loader path.
        env = {**os.environ, "HOME": tmp, "HF_HOME": f"{tmp}/hf", "TMPDIR": tmp, "PYTHONPATH": str(DRIVERS),
               "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "LD_LIBRARY_PATH": ":".join(filter(None, [str(driver_stub(venv)), os.environ.get("LD_LIBRARY_PATH")]))}
        start = time.monotonic()
        failure: dict
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            failure = {"outcome": "driver crashed", "returncode": proc.returncode, "stderr_tail": proc.stderr[-3000:]}
        except subprocess.TimeoutExpired:
            failure = {"outcome": "driver timed out", "seconds": timeout}
        answered: dict = {"failure": failure}
        for j in range(len(exports)):
            f = out / f"{j}.json"
            if f.exists():
                answered[j] = json.loads(f.read_text())
        answered["failure"]["seconds"] = round(time.monotonic() - start, 1)
    return answered


# Errors that are the CPU's, not the engine's answer: a CUDA op without a CPU kernel, torch.compile of a
# GPU path, a kernel entry point that did not load, a call that needs the GPU driver.
CPU_LIMITS = ("from the 'CPU' backend", "InternalTorchDynamoError", "'NoneType' object is not callable",
              "Found no NVIDIA driver", "Torch not compiled with CUDA")


def cpu_limit(error: dict) -> bool:
    return any(s in f"{error.get('type')}: {error.get('message')}" for s in CPU_LIMITS)


def observed_verdict(result: dict) -> str | None:
    """The check-vocabulary verdict the engine's behaviour amounts to (None: not observed, because the
    driver did not get far enough or the step needs a GPU)."""
    if result.get("error"):
        if cpu_limit(result["error"]):
            return None
        return REFUSES if result["error"]["stage"] in ("build", "load_weights", "post_process") else None
    if result.get("outcome") != "ran":
        return None
    load = result["load"]
    post = result.get("post_load", {})
    if load["not_landed"] or load["params_never_written"] or post.get("mismatches"):
        return DIFFERENT
    return LOADS


def check_verdicts(export: Path) -> dict:
    from .. import check_export

    report = check_export(export, CHECK_ENGINES)
    out = {}
    for name, r in report.results.items():
        entry = {"verdict": r.verdict}
        if r.refusals:
            entry["first"] = f"{r.refusals[0].tensor}: {r.refusals[0].reason}"[:400]
        elif r.deviations:
            entry["first"] = f"{r.deviations[0].module}: {r.deviations[0].what}"[:400]
        out[name] = entry
    return out


def run_matrix(engines: list[EngineSpec], *, venv_root: Path, work: Path, cell_ids: list[str] | None,
               timeout: float, reuse_exports: bool = False, say=print) -> dict:
    from .matrix import CELLS, build_export

    cells = [c for c in CELLS if not cell_ids or c.id in cell_ids]
    built: dict[str, Path] = {}
    rows = []
    for cell in cells:
        say(f"[export] {cell.id}")
        export = build_export(cell, work, built, reuse=reuse_exports)
        rows.append({"id": cell.id, "how": cell.how, "recipe": cell.recipe, "tiny": cell.tiny, "about": cell.about,
                     "check": check_verdicts(export), "observed": {}, "_export": export})
    versions = {}
    for spec in engines:
        venv = ensure_venv(spec, venv_root, say=say)
        versions[spec.name] = installed_version(venv, spec.name)
        say(f"[{spec}] {len(rows)} exports in one engine process")
        for row, result in zip(rows, run_driver(spec, venv, [r["_export"] for r in rows], timeout=timeout)):
            result["verdict"] = observed_verdict(result)
            result.setdefault("not_observable", list(NOT_OBSERVABLE[spec.name]))
            row["observed"][spec.name] = result
            say(f"  {row['id']}: {result['verdict'] or result.get('outcome')} (check: {row['check'][spec.name]['verdict']})")
    for row in rows:
        row.pop("_export")
    return {"engines": versions, "cells": rows}


def main(argv: list[str] | None = None) -> int:
    import argparse

    from .matrix import CELLS
    from .report import write_report

    p = argparse.ArgumentParser(prog="python -m modelopt_k3.check.conformance",
                                description="Run vLLM's and SGLang's own Kimi-K3 loaders on CPU over the "
                                            "conformance matrix and compare with modelopt-k3-check.")
    p.add_argument("--engine", action="append", default=None, metavar="NAME==VERSION",
                   help="engine release from PyPI (repeatable; default: the pins in conformance/__init__.py)")
    p.add_argument("--venv_root", type=Path, default=None, help="where the engine venvs are cached")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "modelopt_k3" / "conformance",
                   help="scratch directory for the tiny checkpoints and the matrix's exports")
    p.add_argument("--cells", default=None, help=f"comma-separated subset of: {', '.join(c.id for c in CELLS)}")
    p.add_argument("--timeout", type=float, default=900, help="seconds per (engine, cell)")
    p.add_argument("--reuse_exports", action="store_true",
                   help="keep the exports a previous run under --work finished building (same code only)")
    p.add_argument("--json", type=Path, default=Path("tests/data/engine_conformance.json"))
    p.add_argument("--report", type=Path, default=Path("docs/ENGINE_CONFORMANCE.md"))
    args = p.parse_args(argv)
    from . import PINNED
    from .venv import DEFAULT_ROOT

    engines = [EngineSpec.parse(e) for e in (args.engine or PINNED)]
    result = run_matrix(engines, venv_root=args.venv_root or DEFAULT_ROOT, work=args.work,
                        cell_ids=args.cells.split(",") if args.cells else None, timeout=args.timeout,
                        reuse_exports=args.reuse_exports)
    if args.cells and args.json.exists():  # a subset updates its cells in the committed matrix
        old = json.loads(args.json.read_text())
        fresh = {r["id"]: r for r in result["cells"]}
        result["cells"] = [fresh.pop(r["id"], r) for r in old["cells"]] + list(fresh.values())
    write_report(result, args.json, args.report)
    print(f"wrote {args.json} and {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
