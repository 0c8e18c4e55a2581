"""Run the benchmark suite: ``python -m benchmarks`` (or ``python benchmarks/run.py``) from the repo root.

    python -m benchmarks                 # everything (< ~10 min on a 2-core CPU machine)
    python -m benchmarks --quick         # smoke run: small shapes, tiny checkpoints, no convert
    python -m benchmarks --only numerics # one area (numerics, io, ep, memory, layerwise, calibrators, gptq_batched, convert,
                                         # wall_time); repeat or
                                         # comma-join; writes results/<areas>.json and .md, not the full run's files
    python -m benchmarks --out DIR       # write results.json / RESULTS.md into DIR
    python -m benchmarks --only convert --convert_size multi-gb   # converter vs ModelOpt's on ~2.2 GB

Writes ``results.json`` (machine facts, versions, every figure with min/median/max over repeats,
its reference, ratio, target, verdict -- met, missed or report -- and what bounds it) and
``RESULTS.md`` (a short table). A missed target is reported with what bounds it, never lowered, and
does not fail the run; exits 1 if a correctness check on a benchmark's outputs fails, an area fails to run
(a negative, NaN or infinite figure is such a failure: ``common.FigureError``) or a figure with a target
could not be measured (e.g. the converter peer is not set up: listed as "skipped: no peer"), else 0. Each
area runs in a fresh process (``run_area_in_fresh_process``), so no figure depends on the order of areas.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # ``python benchmarks/run.py``: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from benchmarks.common import Context, Figure, machine_facts  # noqa: E402

HERE = Path(__file__).resolve().parent
AREAS = {
    "numerics": "benchmarks.bench_numerics",
    "io": "benchmarks.bench_io",
    "ep": "benchmarks.bench_ep",
    "memory": "benchmarks.bench_memory",
    "layerwise": "benchmarks.bench_layerwise",
    "calibrators": "benchmarks.bench_calibrators",
    "gptq_batched": "benchmarks.bench_gptq_batched",
    "convert": "benchmarks.convert_area",
    "wall_time": "benchmarks.bench_wall_time",
    "peer_calibrators": "benchmarks.bench_peer_calibrators",
}
QUICK_SKIPS = {"convert": "bench_convert.py builds a ~0.5 GB checkpoint; run it with --only convert",
               "wall_time": "bench_wall_time.py times eight hf_ptq runs (~1.5 min); run it with --only wall_time",
               "peer_calibrators": "llm-compressor's oneshot takes minutes per method on CPU; run it with "
                                   "--only peer_calibrators"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: small sizes, 1 repeat, EP 1 and 2 only, convert skipped")
    p.add_argument("--only", action="append", default=None, metavar="NAME",
                   help=f"run only these areas ({', '.join(AREAS)}); repeat or comma-join")
    p.add_argument("--out", type=Path, default=None,
                   help="directory for results.json and RESULTS.md (default: benchmarks/ for a full run; a run of "
                        "some areas writes benchmarks/results/<areas>.json and .md, leaving the full run's files)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per figure (default 5, quick 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads in this process (default: all cores; EP ranks share them)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="scratch dir; checkpoints built there are reused (default: $TMPDIR/modelopt_k3_benchmarks)")
    p.add_argument("--convert_size", choices=("default", "multi-gb"), default="default",
                   help="convert area: default ~0.5 GB checkpoints (a few minutes), multi-gb ~2.2 GB (~15 min with the peer)")
    p.add_argument("--peer_python", default=None,
                   help="interpreter with nvidia-modelopt for the peer converter (default $MODELOPT_K3_PEER_PYTHON)")
    p.add_argument("--peer_script", default=None,
                   help="ModelOpt's examples/kimi/kimi_k3/quantize_to_nvfp4.py (default $MODELOPT_K3_PEER_SCRIPT)")
    p.add_argument("--llmc_python", default=None,
                   help="interpreter with llmcompressor==0.14.0.1 for the peer calibrators "
                        "(default $MODELOPT_K3_LLMC_PYTHON)")
    return p


def _fmt_value(side: dict, unit: str) -> str:
    if "median" in side:
        s = side["median"]
        return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"
    if "gbps" in side:
        return f"{side['gbps']:.2f} GB/s"
    if "value" in side:
        v = side["value"]
        return f"{v:.3g} {side.get('unit', unit)}".strip() if isinstance(v, float) else f"{v} {side.get('unit', unit)}"
    return "-"


def render_markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        "# Benchmark results",
        "",
        f"{m['date']} · {m['cpu_model']} · {m['cpu_cores_logical']} cores · "
        f"{m['memory_total_bytes'] / 2**30:.0f} GiB · torch {m['torch']} · transformers {m['transformers']} · "
        f"compressed-tensors {m['compressed_tensors']} · safetensors {m['safetensors']} · "
        f"{results['suite']['threads']} torch threads · load average {m['load_average_at_start'][0]:.1f} at start, "
        f"{results['load_average_at_end'][0]:.1f} at end"
        + f" · commit {str(m.get('git_commit'))[:10]}"
        + (f" + uncommitted {', '.join(m['uncommitted_package_files'])}" if m.get("uncommitted_package_files") else "")
        + (" · **--quick (smoke run, not the real figures)**" if results["suite"]["quick"] else ""),
        "",
        "Medians over repeats (min/max and every sample in `results.json`); ratio = reference time / our "
        "time unless stated; [min–max] of the paired per-repeat ratios.",
        "",
        "| figure | ours | reference | ratio | target | result |",
        "|---|---|---|---|---|---|",
    ]
    for f in results["figures"]:
        if f["verdict"] == "skipped":
            lines.append(f"| {f['title']} | - | - | - | {f['target_text']} | **skipped: {f['skipped']}** |")
            continue
        rng = f.get("ratio_range")
        ratio = f"{f['ratio']:.3g}" + (f" [{rng[0]:.3g}–{rng[1]:.3g}]" if rng else "")
        result = {"met": "met", "missed": "**missed**", "report": "report"}[f["verdict"]]
        if f["failed_checks"]:
            result += f" · **wrong: {', '.join(f['failed_checks'])}**"
        lines.append(
            f"| {f['title']} | {_fmt_value(f['ours'], f['unit'])} | {_fmt_value(f['reference'], f['unit'])} "
            f"| {ratio} | {f['target_text']} | {result} |"
        )
    sides: dict[str, set[tuple[str, str]]] = {}
    for f in results["figures"]:
        if f["verdict"] == "skipped":
            continue
        sides.setdefault(f["name"].split("/")[0], set()).add((f["ours"].get("label", ""), f["reference"].get("label", "")))
    lines += ["", "What each side runs (details in the `benchmarks/bench_*.py` docstrings):", ""]
    # a family whose figures compare different things says so, rather than naming its first figure's sides
    lines += [f"- `{family}`: ours = {next(iter(pairs))[0]}; reference = {next(iter(pairs))[1]}" if len(pairs) == 1
              else f"- `{family}`: {len(pairs)} pairs of sides; each figure's are in `results.json` (`ours.label`, "
                   "`reference.label`)" for family, pairs in sides.items()]
    for extra in results.get("areas", {}).values():
        table = extra.get("markdown") if isinstance(extra, dict) else None
        if table:
            lines += ["", table]
    failed = [f for f in results["figures"] if f["passed"] is False]
    if failed:
        lines += ["", "## Targets missed", ""]
        said: dict[str, str] = {}
        for f in failed:
            bound = f["bound"]
            if bound in said:
                bound = f"(Bound: as for {said[bound]}.)"
            elif bound:
                said[bound] = f["title"]
                if not bound.lower().startswith("what bounds it"):
                    bound = f"What bounds it: {bound}."
            lines.append(f"- **{f['title']}**: {f['shortfall']}." + (f" {bound}" if bound else ""))
    unmeasured = [f for f in results["figures"] if f["verdict"] == "skipped" and f["target"] is not None]
    if unmeasured:
        lines += ["", "## Targeted figures not measured (the run exits 1)", ""]
        lines += [f"- **{f['title']}** ({f['target_text']}): skipped, {f['skipped']}" for f in unmeasured]
    wrong = [f for f in results["figures"] if f["failed_checks"]]
    if wrong:
        lines += ["", "## Correctness checks failed", ""]
        lines += [f"- **{f['title']}**: {', '.join(f['failed_checks'])}" for f in wrong]
    if results["errors"]:
        lines += ["", "## Areas that failed to run", ""]
        for area, err in results["errors"].items():
            last = [line for line in err.splitlines() if line.strip()][-1:] or ["?"]
            lines.append(f"- {area}: `{last[0].strip()}` (traceback in results.json)")
    if results["skipped"]:
        lines += ["", "Skipped: " + "; ".join(f"{a} ({why})" for a, why in results["skipped"].items())]
    return "\n".join(lines) + "\n"


def _result_paths(out: Path | None, only: list[str], quick: bool) -> tuple[Path, Path]:
    """Where a run writes: ``--out`` (results.json, RESULTS.md); else the committed full run's files for a full
    run, and ``results/<areas>[-quick].json``/``.md`` for a partial one (it must not replace the full run's)."""
    if out is not None:
        return out / "results.json", out / "RESULTS.md"
    if not only and not quick:
        return HERE / "results.json", HERE / "RESULTS.md"
    stem = "-".join(only or ["all"]) + ("-quick" if quick else "")
    return HERE / "results" / f"{stem}.json", HERE / "results" / f"{stem}.md"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_area_worker"]:
        return _area_worker(Path(argv[1]), Path(argv[2]))
    args = build_parser().parse_args(argv)
    only = [a for item in (args.only or []) for a in item.split(",") if a]
    unknown = sorted(set(only) - set(AREAS))
    if unknown:
        print(f"unknown area(s) {unknown}; known: {', '.join(AREAS)}", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / "modelopt_k3_benchmarks"
    workdir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = _result_paths(args.out, only, args.quick)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    repeats = args.repeats or (1 if args.quick else 5)

    def log(msg: str) -> None:
        print(f"[bench {time.perf_counter() - t0:6.1f}s] {msg}", flush=True)

    import torch

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for the subprocesses (EP ranks divide it)
    t0 = time.perf_counter()
    ctx = Context(quick=args.quick, repeats=repeats, workdir=workdir, out_dir=json_path.parent, log=log, threads=threads,
                  convert_size=args.convert_size, peer_python=args.peer_python, peer_script=args.peer_script,
                  llmc_python=args.llmc_python)
    busy = os.getloadavg()[0]
    if busy > 0.5 * (os.cpu_count() or 1):
        log(f"warning: load average {busy:.1f} on {os.cpu_count()} cores before starting: other jobs share the "
            "CPU, so absolute timings are pessimistic (ratios are interleaved, but multi-threaded ops can stall)")
    results: dict = {
        "machine": machine_facts(),
        "suite": {"quick": args.quick, "repeats": repeats, "threads": threads, "only": only or None,
                  "argv": sys.argv[1:]},
        "figures": [],
        "areas": {},
        "errors": {},
        "skipped": {},
    }
    for area, module in AREAS.items():
        if only and area not in only:
            continue
        if args.quick and area in QUICK_SKIPS and area not in only:
            results["skipped"][area] = QUICK_SKIPS[area]
            continue
        log(f"== {area} (in a fresh process)")
        started, load_before = time.perf_counter(), os.getloadavg()[0]
        out = run_area_in_fresh_process(module, ctx)
        if "error" in out:
            results["errors"][area] = out["error"]
            log(f"{area} FAILED:\n{results['errors'][area]}")
            continue
        extra = {**out["extra"], "wall_s": time.perf_counter() - started,
                 "load_average_1min_before_after": (load_before, os.getloadavg()[0])}
        results["areas"][area] = extra
        for d in out["figures"]:
            results["figures"].append(d)
            wrong = f" WRONG: {', '.join(d['failed_checks'])}" if d["failed_checks"] else ""
            ratio = f"ratio {d['ratio']:.3g}" if d["verdict"] != "skipped" else f"not measured ({d['skipped']})"
            log(f"{d['title']}: {ratio} ({d['target_text']}) {d['verdict']}{wrong}")
    results["suite"]["wall_s"] = time.perf_counter() - t0
    results["load_average_at_end"] = os.getloadavg()
    results["correct"] = not results["errors"] and not any(f["failed_checks"] for f in results["figures"])
    results["targets_met"] = all(f["verdict"] != "missed" for f in results["figures"])
    results["targets_not_measured"] = [f["name"] for f in results["figures"]
                                       if f["verdict"] == "skipped" and f["target"] is not None]

    json_path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    md_path.write_text(render_markdown(results))
    unmeasured = results["targets_not_measured"]
    log(f"wrote {json_path} and {md_path} "
        f"({'correct' if results['correct'] else 'ERRORS or failed correctness checks'}; "
        f"{'all targets met' if results['targets_met'] else 'targets missed: see what bounds them'}"
        + (f"; targeted figures NOT MEASURED: {', '.join(unmeasured)}" if unmeasured else "") + ")")
    return 0 if results["correct"] and not unmeasured else 1


# ------------------------------------------------------------------------------ one area, one process
# Every area runs in a fresh interpreter, so no figure depends on what ran before it in the suite (a
# process's peak RSS, allocator caches and warmed tables carried over between areas: the layerwise
# planned-vs-measured peak read 1.01 alone and 3.23 after the other areas).


def run_area_in_fresh_process(module: str, ctx: Context) -> dict:
    """``module.run(ctx)`` in a child interpreter: ``{"figures": [dict], "extra": dict}`` or ``{"error": str}``."""
    with tempfile.TemporaryDirectory(prefix="bench_area_") as tmp:
        spec_path, result_path = Path(tmp) / "ctx.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps({"module": module, "context": _context_fields(ctx)}))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--_area_worker", str(spec_path),
                               str(result_path)], cwd=HERE.parent, env=env)
        if not result_path.exists():
            return {"error": f"the area's process exited {proc.returncode} without a result"}
        return json.loads(result_path.read_text())


def _context_fields(ctx: Context) -> dict:
    return {f.name: str(v) if isinstance(v, Path) else v
            for f in dataclasses.fields(ctx) if f.name != "log" for v in (getattr(ctx, f.name),)}


def _area_worker(spec_path: Path, result_path: Path) -> int:
    """The child side of ``run_area_in_fresh_process``."""
    import torch

    spec = json.loads(spec_path.read_text())
    fields = spec["context"]
    for name in ("workdir", "out_dir"):
        fields[name] = Path(fields[name])
    torch.set_num_threads(fields["threads"])
    t0 = time.perf_counter()
    area = spec["module"].rsplit(".", 1)[-1]
    ctx = Context(**fields, log=lambda msg: print(f"[{area} {time.perf_counter() - t0:6.1f}s] {msg}", flush=True))
    try:
        out = importlib.import_module(spec["module"]).run(ctx)
        figures, extra = out if isinstance(out, tuple) else (out, {})
        result = {"figures": [f.to_dict() if isinstance(f, Figure) else f for f in figures], "extra": extra}
    except Exception:
        result = {"error": traceback.format_exc()}
    result_path.write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
