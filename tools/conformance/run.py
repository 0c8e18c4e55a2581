"""Run the engines' own loaders over exports and compare with ``modelopt-k3-check``'s verdicts.

Per (engine version, export) cell a driver runs in the engine's venv (``drivers/<engine>_<model>.py``,
chosen by the export's ``model_type``: ``DRIVER_MODELS``; a subprocess with a timeout) and writes what it saw as JSON; ``verdict.py`` turns that into an observed
verdict in the check's vocabulary (refuses / loads but serves different numbers / loads correctly).

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

from .venv import EngineSpec, driver_stub, ensure_venv, installed_version, python_of
from .verdict import observed_verdict

DRIVERS = Path(__file__).parent / "drivers"
# config.json model_type -> the drivers' model suffix (drivers/<engine>_<suffix>.py builds the engine's own class).
DRIVER_MODELS = {"kimi_k3": "k3", "qwen3_moe": "qwen3", "gpt_oss": "gpt_oss", "deepseek_v3": "deepseek_v3",
                 "nemotron_h": "nemotron_h", "kimi_k25": "kimi_k25",
                 "minimax_m2": "minimax_m2",
                 # GLM-5: both engines' GlmMoeDsaForCausalLM subclasses their DeepSeek-V2 class, same names.
                 "glm_moe_dsa": "deepseek_v3",
                 "qwen3_5_moe": "qwen3_5_moe"}
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


def driver_of(spec: EngineSpec, export: Path) -> Path:
    """The driver that builds ``spec``'s own model class for ``export`` (by its config.json ``model_type``)."""
    model_type = json.loads((export / "config.json").read_text()).get("model_type")
    if model_type not in DRIVER_MODELS:
        raise ValueError(f"{export}: no conformance driver for model_type {model_type!r}; known: {sorted(DRIVER_MODELS)}")
    return DRIVERS / f"{spec.name}_{DRIVER_MODELS[model_type]}.py"


def run_driver(spec: EngineSpec, venv: Path, exports: list[Path], *, timeout: float,
               options: dict | None = None) -> list[dict]:
    """The driver's JSON for each export, in order. One engine process per driver (``driver_of``) loads its
    exports in turn (importing the engine is most of a run); when it dies or times out, the exports it had
    not answered are each retried in a process of their own, so one bad cell cannot hide the others."""
    results: dict[int, dict] = {}
    by_driver: dict[Path, list[int]] = {}
    for i, e in enumerate(exports):
        by_driver.setdefault(driver_of(spec, e), []).append(i)
    for driver, indices in by_driver.items():
        for i, r in zip(indices, _run_one_driver(driver, venv, [exports[i] for i in indices],
                                                 timeout=timeout, options=options)):
            results[i] = r
    return [results[i] for i in range(len(exports))]


def _run_one_driver(driver: Path, venv: Path, exports: list[Path], *, timeout: float, options) -> list[dict]:
    before = {e: export_fingerprint(e) for e in exports}
    results: dict[int, dict] = {}
    pending = list(range(len(exports)))
    batch = True
    while pending:
        group = pending if batch else pending[:1]
        answered = _driver_process(driver, venv, [exports[i] for i in group], timeout * len(group), options)
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


def _driver_process(driver: Path, venv: Path, exports: list[Path], timeout: float, options) -> dict:
    with tempfile.TemporaryDirectory(prefix="k3conf-") as tmp:
        out = Path(tmp) / "results"
        out.mkdir()
        cmd = [str(python_of(venv)), str(driver), "--exports", *map(str, exports),
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


def check_verdicts(export: Path) -> dict:
    from modelopt_k3.check import check_export

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
               timeout: float, reuse_exports: bool = False, pip_constraint: str | None = None, say=print) -> dict:
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
    for spec in sorted(engines, key=lambda e: e.name):  # stable: engines by name, whatever the --engine order
        venv = ensure_venv(spec, venv_root, say=say, pip_constraint=pip_constraint)
        versions[spec.name] = installed_version(venv, spec.name)
        say(f"[{spec}] {len(rows)} exports, one engine process per model's driver")
        for row, result in zip(rows, run_driver(spec, venv, [r["_export"] for r in rows], timeout=timeout)):
            result["verdict"] = observed_verdict(result)
            result.setdefault("not_observable", list(NOT_OBSERVABLE[spec.name]))
            row["observed"][spec.name] = result
            say(f"  {row['id']}: {result['verdict'] or result.get('outcome')} (check: {row['check'][spec.name]['verdict']})")
    for row in rows:
        row.pop("_export")
    return {"engines": versions, "cells": rows}


REPO = Path(__file__).resolve().parents[2]  # the committed files are the repository's, wherever it runs from
COMMITTED_JSON = REPO / "tests" / "data" / "engine_conformance.json"
COMMITTED_DOC = REPO / "docs" / "ENGINE_CONFORMANCE.md"
JSON_NAME, DOC_NAME = COMMITTED_JSON.name, COMMITTED_DOC.name


def parse_args(argv: list[str] | None = None):
    """The command's arguments, every one validated before anything is installed, built or written: a bad
    one is one ``error:`` line (exit 2)."""
    import argparse

    from . import PINNED
    from .matrix import CELLS

    p = argparse.ArgumentParser(prog="python -m tools.conformance",
                                description="Run vLLM's and SGLang's own model loaders (one driver per model type) on CPU "
                                            "over the "
                                            "conformance matrix and compare with modelopt-k3-check; exits 1 on "
                                            "any disagreement.")
    p.add_argument("--engine", action="append", default=None, metavar="NAME==VERSION",
                   help="engine release from PyPI (repeatable; default: the pins in tools/conformance/__init__.py)")
    p.add_argument("--venv_root", type=Path, default=None, help="where the engine venvs are cached")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "modelopt_k3" / "conformance",
                   help="scratch directory for the tiny checkpoints and the matrix's exports")
    p.add_argument("--cells", default=None, help=f"comma-separated subset of: {', '.join(c.id for c in CELLS)}")
    p.add_argument("--timeout", type=float, default=900, help="seconds per (engine, cell); > 0")
    p.add_argument("--reuse_exports", action="store_true",
                   help="keep the exports a previous run under --work finished building (same code only)")
    p.add_argument("--out", type=Path, default=Path("conformance-out"),
                   help=f"directory for the results ({JSON_NAME}, {DOC_NAME}); the committed files are untouched")
    p.add_argument("--update_committed", action="store_true",
                   help=f"also regenerate {COMMITTED_JSON} and {COMMITTED_DOC} (a --cells subset updates its rows; "
                        "the doc's hand-written sections are kept)")
    p.add_argument("--recheck", action="store_true",
                   help=f"no engine run: rebuild the cells' exports, re-run modelopt-k3-check on them and rewrite the "
                        f"check verdicts of {COMMITTED_JSON} / {COMMITTED_DOC} (the recorded observations kept)")
    p.add_argument("--pip_constraint", default=None, metavar="FILE",
                   help="PIP_CONSTRAINT for the engine installs ('' for none); default: the environment's, as is")
    args = p.parse_args(argv)
    try:
        args.engines = [EngineSpec.parse(e) for e in (args.engine or PINNED)]
    except ValueError as e:
        p.error(str(e))
    names = [e.name for e in args.engines]
    if len(set(names)) != len(names):
        p.error(f"--engine names one engine twice: {names}")
    known = {c.id for c in CELLS}
    args.cell_ids = [c.strip() for c in args.cells.split(",") if c.strip()] if args.cells is not None else None
    if args.cell_ids is not None:
        unknown = [c for c in args.cell_ids if c not in known]
        if unknown or not args.cell_ids:
            p.error(f"--cells: unknown cell id(s) {unknown or args.cells!r}; known: {', '.join(sorted(known))}")
    if not args.timeout > 0:
        p.error(f"--timeout must be > 0 seconds, got {args.timeout:g}")
    if args.pip_constraint and not Path(args.pip_constraint).is_file():
        p.error(f"--pip_constraint {args.pip_constraint}: no such file")
    from modelopt_k3.files.paths import OWNED_RECORD, DestinationError, check_owned_dir

    try:  # where the results go, before anything is installed or run
        check_owned_dir(args.out, [JSON_NAME, DOC_NAME, OWNED_RECORD], flag="--out")
    except DestinationError as e:
        p.error(str(e))
    return args


def disagreements(doc: dict) -> list[tuple[str, str]]:
    """(cell, engine) pairs whose observed verdict differs from the check's (not-observed cells never count)."""
    from .report import agreement

    return [(row["id"], e) for row in doc["cells"] for e in sorted(row["observed"]) if agreement(row, e) is False]


def recheck(doc: dict, work: Path, cell_ids: list[str] | None, *, reuse_exports: bool, say=print) -> dict:
    """``doc`` with the check verdicts of its cells (or of ``cell_ids``) recomputed on freshly built exports."""
    from .matrix import CELLS, build_export

    built: dict[str, Path] = {}
    cells = {c.id: c for c in CELLS}
    for row in doc["cells"]:
        if row["id"] in cells and (not cell_ids or row["id"] in cell_ids):
            say(f"[recheck] {row['id']}")
            row["check"] = check_verdicts(build_export(cells[row["id"]], work, built, reuse=reuse_exports))
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from .matrix import CELLS
    from .report import merge_rows, write_report
    from .venv import DEFAULT_ROOT

    if args.recheck:
        doc = recheck(json.loads(COMMITTED_JSON.read_text()), args.work, args.cell_ids,
                      reuse_exports=args.reuse_exports)
        written = write_report(doc, COMMITTED_JSON, COMMITTED_DOC, order=[c.id for c in CELLS],
                               keep_sections_of=COMMITTED_DOC, generated=doc.get("generated"))
        print(f"updated the check verdicts of {COMMITTED_JSON} and {COMMITTED_DOC}")
        return _exit(disagreements(written))

    result = run_matrix(args.engines, venv_root=args.venv_root or DEFAULT_ROOT, work=args.work,
                        cell_ids=args.cell_ids, timeout=args.timeout, reuse_exports=args.reuse_exports,
                        pip_constraint=args.pip_constraint)
    order = [c.id for c in CELLS]
    written = write_report(result, args.out / JSON_NAME, args.out / DOC_NAME, order=order, owned_flag="--out")
    print(f"wrote {args.out / JSON_NAME} and {args.out / DOC_NAME}")
    if args.update_committed:
        committed = result
        if COMMITTED_JSON.exists():
            old = json.loads(COMMITTED_JSON.read_text())
            if args.cell_ids:  # a subset updates its rows of the committed matrix
                committed = merge_rows(old, result, order)
            elif old.get("trtllm_replay"):  # the TensorRT-LLM replay's rows (tools.conformance.trtllm) stay
                committed = {**result, "trtllm_replay": old["trtllm_replay"]}
        write_report(committed, COMMITTED_JSON, COMMITTED_DOC, order=order, keep_sections_of=COMMITTED_DOC)
        print(f"updated {COMMITTED_JSON} and {COMMITTED_DOC}")
    return _exit(disagreements(written))


def _exit(found: list[tuple[str, str]]) -> int:
    if found:
        print(f"{len(found)} disagreement(s) between modelopt-k3-check and the engines: "
              + ", ".join(f"{c} ({e})" for c, e in found), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
