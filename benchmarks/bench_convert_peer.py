"""Our converter beside ModelOpt's own calibration-free Kimi-K3 converter, and both beside the copy floor.

    python benchmarks/bench_convert_peer.py [--size default|multi-gb] [--repeats 2] [--parallel 1,2]
        [--peer_python PY] [--peer_script quantize_to_nvfp4.py] [--workdir DIR] [--no_write]

The peer is ModelOpt's ``examples/kimi/kimi_k3/quantize_to_nvfp4.py`` (the tool a Kimi-K3 user would
otherwise run), never a dependency of this project: it runs with its own interpreter, found by
``--peer_python`` / ``$MODELOPT_K3_PEER_PYTHON`` (a venv with ``nvidia-modelopt==0.47.0``) and
``--peer_script`` / ``$MODELOPT_K3_PEER_SCRIPT`` (the script at the pinned Model-Optimizer commit, see
``benchmarks/README.md``). When either is missing or the interpreter cannot import ``modelopt`` the
peer is skipped and the results say so; ours and the copy floor are still measured.

Both sides convert the same generated stand-in Kimi-K3 checkpoint (the project's generator, more and
larger experts, several shards; ``--size multi-gb``: ~2.2 GB in 4 shards) with the same Kimi-K3 mirror
recipe (experts NVFP4 by the lossless cast, attention 128x128 block FP8), each as its own command line
(``modelopt-k3-convert`` / the peer script) in a fresh process, into a fresh output directory, from a
warm page cache. Parallelism is matched: at ``P`` the peer runs ``--jobs P --threads_per_job C/P`` and
ours runs ``P`` rank processes (``--rank r --world_size P --workers C/P``), ``C`` = the cores.
The copy floor reads and writes every source shard in 64 MiB chunks and fsyncs each file (what ``cp``
+ fsync does; the converter fsyncs every shard too). Each repeat runs copy, ours and peer in turn (the
order alternates); wall times, MB/s of source bytes and the peak RSS of each side's process tree
(children and ranks summed, sampled every 100 ms; ``ru_maxrss`` of the largest single process too)
are recorded, with the load average around the runs. Results go to ``benchmarks/results/convert_peer.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_convert as bc  # noqa: E402  (the checkpoint builder and the copy floor)

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "convert_peer.json"
OURS_RECIPE = bc.RECIPE
PEER_RECIPE = "huggingface/models/moonshotai/Kimi-K3/ptq/nvfp4_experts-fp8_pb_attention"  # the same mirror recipe
PEER_PIN = {"package": "nvidia-modelopt==0.47.0", "repo": "NVIDIA/Model-Optimizer",
            "commit": "575c27ae", "path": "examples/kimi/kimi_k3/quantize_to_nvfp4.py"}
# name -> the generator's sizes (bench_convert.build_checkpoint); every expert whole in one shard: the
# peer refuses an expert whose w1 and w3 sit in different shards (the real release never splits one)
SIZES = {"default": {"experts": 64, "shard_mb": 192, "moe_intermediate": 1024, "whole_experts": True},
         "multi-gb": bc.MULTI_GB}


def build(workdir: Path, size: str) -> Path:
    return bc.build_checkpoint(workdir, **SIZES[size])


def find_peer(python: str | None, script: str | None) -> tuple[list[str] | None, str]:
    """The peer's command prefix, or None and why it is skipped."""
    python = python or os.environ.get("MODELOPT_K3_PEER_PYTHON")
    script = script or os.environ.get("MODELOPT_K3_PEER_SCRIPT")
    if not python or not script:
        return None, ("peer not configured: set --peer_python/--peer_script or $MODELOPT_K3_PEER_PYTHON/"
                      "$MODELOPT_K3_PEER_SCRIPT (setup: benchmarks/README.md)")
    if not Path(script).is_file():
        return None, f"peer script {script} does not exist"
    probe = subprocess.run([python, "-c", "import modelopt; print(modelopt.__version__)"], capture_output=True,
                           text=True)
    if probe.returncode:
        return None, f"peer interpreter {python} cannot import modelopt: {probe.stderr.strip()[-300:]}"
    return [python, script], f"nvidia-modelopt {probe.stdout.strip()} ({python}), script {script}"


class TreePeak:
    """Peak of the summed RSS of some process trees, sampled every ``interval`` seconds."""

    def __init__(self, pids: list[int], interval: float = 0.1):
        import psutil

        self.procs = [psutil.Process(p) for p in pids]
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        import psutil

        while not self._stop.is_set():
            total = 0
            for root in self.procs:
                try:
                    for p in [root, *root.children(recursive=True)]:
                        total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_procs(cmds: list[list[str]], env: dict, log: Path) -> dict:
    """Start every command at once, wait for all; wall seconds, summed tree peak RSS, largest ru_maxrss."""
    with open(log, "a") as out:
        t0 = time.perf_counter()
        procs = [subprocess.Popen(c, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO) for c in cmds]
        peak = TreePeak([p.pid for p in procs])
        maxrss, codes = 0, []
        for p in procs:
            _, status, usage = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
            codes.append(p.returncode)
            maxrss = max(maxrss, usage.ru_maxrss * 1024)
        wall = time.perf_counter() - t0
    tree = peak.stop()
    if any(codes):
        raise RuntimeError(f"{cmds[0][:3]}... exited {codes}; see {log}")
    return {"s": wall, "tree_peak_rss": tree, "max_single_rss": maxrss}


def ours_cmds(src: Path, dst: Path, p: int, cores: int) -> list[list[str]]:
    base = [sys.executable, "-m", "modelopt_k3.cli.convert", "--src", str(src), "--dst", str(dst),
            "--recipe", OURS_RECIPE, "--workers", str(max(1, cores // p)), "--no_progress"]
    return [base + ["--rank", str(r), "--world_size", str(p)] for r in range(p)]


def peer_recipe(script: str) -> str:
    """The mirror recipe as the pinned checkout holds it (an absolute path), else its name. The script puts its
    checkout first on ``sys.path``, so ``modelopt_recipes`` is the checkout's, where this recipe sits under
    ``huggingface/models/``; the 0.47 wheel's loader rewrites that prefix to ``models/``, which only the wheel
    has: by name, the pinned script cannot find its own recipe."""
    pinned = Path(script).resolve().parents[3] / "modelopt_recipes" / f"{PEER_RECIPE}.yaml"
    return str(pinned) if pinned.is_file() else PEER_RECIPE


def peer_cmd(prefix: list[str], src: Path, dst: Path, p: int, cores: int) -> list[list[str]]:
    return [prefix + ["--source_ckpt", str(src), "--output_ckpt", str(dst), "--recipe", peer_recipe(prefix[-1]),
                      "--jobs", str(p), "--threads_per_job", str(max(1, cores // p))]]


def measure(args, ckpt: Path, peer: list[str] | None) -> dict:
    cores = os.cpu_count() or 1
    paths = bc.shards(ckpt)
    work = args.workdir
    log = work / "runs.log"
    log.write_text("")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_MODULES_CACHE": str(work / "hf_modules")}
    peer_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    sides = {
        "copy": lambda p: {"s": bc.plain_copy(paths, work / "copy_out", fsync=True)},
        "ours": lambda p: run_procs(ours_cmds(ckpt, _fresh(work / "ours_out"), p, cores), env, log),
    }
    if peer is not None:
        sides["peer"] = lambda p: run_procs(peer_cmd(peer, ckpt, _fresh(work / "peer_out"), p, cores), peer_env, log)
    bc.read_all(paths)
    runs: dict = {}
    for k, p in enumerate(args.parallel):
        if k == 0 and args.warmup:
            for fn in sides.values():  # untimed warm-up of each side (bytecode caches, page cache)
                fn(p)
        got: dict[str, list[dict]] = {name: [] for name in sides}
        load = [os.getloadavg()]
        for i in range(args.repeats):
            order = list(sides.items())
            for name, fn in order if i % 2 == 0 else reversed(order):
                got[name].append(fn(p))
            print(f"  P={p} repeat {i}: " + ", ".join(f"{n} {got[n][-1]['s']:.2f}s" for n in got), flush=True)
        load.append(os.getloadavg())
        runs[str(p)] = {"samples": got, "load_average_before_after": load}
    shutil.rmtree(work / "copy_out", ignore_errors=True)
    return runs


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    return path


def summarize(runs: dict, total: int, largest: int) -> dict:
    out = {}
    for p, r in runs.items():
        s = r["samples"]
        med = {name: statistics.median(x["s"] for x in xs) for name, xs in s.items()}
        row = {name: {"median_s": med[name], "mb_per_s": total / med[name] / 1e6, "samples_s": [x["s"] for x in xs]}
               for name, xs in s.items()}
        for name in ("ours", "peer"):
            if name in s:
                row[name]["tree_peak_rss_bytes"] = max(x["tree_peak_rss"] for x in s[name])
                row[name]["max_single_rss_bytes"] = max(x["max_single_rss"] for x in s[name])
                row[name]["tree_peak_rss_over_largest_shard"] = row[name]["tree_peak_rss_bytes"] / largest
        row["ours_over_copy_floor"] = med["copy"] / med["ours"]
        row["ours_over_copy_floor_paired"] = [c["s"] / o["s"] for c, o in zip(s["copy"], s["ours"])]
        if "peer" in s:
            row["speedup_over_peer"] = med["peer"] / med["ours"]
            row["speedup_over_peer_paired"] = [q["s"] / o["s"] for q, o in zip(s["peer"], s["ours"])]
            row["peer_over_copy_floor"] = med["copy"] / med["peer"]
        row["load_average_before_after"] = r["load_average_before_after"]
        out[p] = row
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="default",
                   help="default: ~0.5 GB in 3 shards (bounded run); multi-gb: ~2.2 GB in 4 shards")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=int, choices=(0, 1), default=1,
                   help="1: one untimed run of each side first (bytecode caches); the page cache is warmed anyway")
    p.add_argument("--parallel", default="1,2", help="comma-separated process counts (peer --jobs / our ranks)")
    p.add_argument("--peer_python", default=None)
    p.add_argument("--peer_script", default=None)
    p.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "modelopt_k3_bench_peer")
    p.add_argument("--no_write", action="store_true", help="print the results without writing convert_peer.json")
    args = p.parse_args(argv)
    args.parallel = [int(x) for x in args.parallel.split(",") if x]
    args.workdir.mkdir(parents=True, exist_ok=True)

    peer, peer_note = find_peer(args.peer_python, args.peer_script)
    print(("peer: " if peer else "peer SKIPPED: ") + peer_note, flush=True)
    t0 = time.perf_counter()
    ckpt = build(args.workdir, args.size)
    paths = bc.shards(ckpt)
    total, largest = sum(q.stat().st_size for q in paths), max(q.stat().st_size for q in paths)
    print(f"checkpoint {ckpt}: {len(paths)} shards, {total / 1e9:.2f} GB, largest {largest / 1e6:.0f} MB "
          f"(built/cached in {time.perf_counter() - t0:.1f}s)", flush=True)
    t1 = time.perf_counter()
    runs = measure(args, ckpt, peer)
    import torch

    result = {
        "what": "modelopt-k3-convert vs ModelOpt's quantize_to_nvfp4.py (Kimi-K3 mirror recipe) vs cp + fsync",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "peer": {"found": peer is not None, "note": peer_note, "pin": PEER_PIN, "recipe": PEER_RECIPE},
        "ours": {"recipe": OURS_RECIPE},
        "checkpoint": {"size": args.size, "shards": len(paths), "bytes": total, "largest_shard_bytes": largest},
        "repeats": args.repeats,
        "wall_s": time.perf_counter() - t1,
        "by_parallelism": summarize(runs, total, largest),
        "runs": runs,
        "notes": "each side is its command line in fresh processes (interpreter start and imports included); "
                 "page cache warm; parallelism matched (peer --jobs P --threads_per_job C/P, ours P ranks "
                 "--workers C/P); RSS = summed process-tree peak, sampled every 100 ms",
    }
    print(json.dumps({k: result[k] for k in ("peer", "checkpoint", "repeats", "by_parallelism", "wall_s")}, indent=2))
    if not args.no_write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
