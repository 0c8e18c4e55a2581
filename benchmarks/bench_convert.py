"""Benchmark the calibration-free streaming converter against a plain copy of the same shards.

    python benchmarks/bench_convert.py [--workdir DIR] [--repeats 5] [--experts 64] [--shard_mb 256]
        [--size multi-gb]

Builds a scaled-up tiny Kimi-K3 checkpoint (cached in ``--workdir``), warms the page cache and runs
each side once untimed, then alternates, ``--repeats`` times: a plain read-and-write copy of every
shard (64 MiB chunks, each file fsynced as the converter does; once more without fsync; once more
with fsync and a sha256 of every chunk, the one hash pass the converter makes) and
``convert_checkpoint`` with the Kimi-K3 mirror recipe (sha256 of every source tensor as it is read,
each output shard's digest from the bytes written). Throughput is source bytes per second
of wall time, from the median and from the best of the repeats; the goal is conversion >= 0.6x the
copy. Peak memory is measured in a fresh child process: RSS after imports and planning
(``baseline``) and the peak RSS while converting; the goal is (peak - baseline) <= 0.5x the largest
source shard. Results go to ``benchmarks/results/convert.json``.
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
import time
from pathlib import Path

RECIPE = "models/moonshotai/Kimi-K3/nvfp4_experts-fp8_pb_attention"
RESULTS = Path(__file__).parent / "results" / "convert.json"
CHUNK = 64 * 2**20


def checkpoint_sizes(experts: int) -> dict:
    """Expert matrices 1024x1024 (the real ones are 3072x3584), 3 MoE layers, 32k vocabulary."""
    return {
        "vocab_size": 32768,
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 256,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "linear_num_heads": 8,
        "linear_head_dim": 128,
        "num_experts": experts,
        "num_experts_per_token": 4,
        "moe_intermediate_size": 1024,
        "routed_expert_hidden_size": 1024,
    }


# ``--size multi-gb`` (also ``bench_convert_peer.py``'s): ~2.2 GB in 4 shards of ~670 MB, experts 2048x1024,
# no expert cut by a shard boundary (as the real release stores them; ModelOpt's converter needs it)
MULTI_GB = {"experts": 192, "shard_mb": 640, "moe_intermediate": 2048, "whole_experts": True}


def build_checkpoint(workdir: Path, experts: int, shard_mb: int, moe_intermediate: int = 1024,
                     whole_experts: bool = False) -> Path:
    from modelopt_k3.testing import make_tiny_kimi_k3

    name = f"ckpt-e{experts}-s{shard_mb}" + (f"-m{moe_intermediate}" if moe_intermediate != 1024 else "")
    path = workdir / (name + ("-whole" if whole_experts else ""))
    if (path / "model.safetensors.index.json").exists():
        return path
    tmp = workdir / f".{path.name}.building"
    shutil.rmtree(tmp, ignore_errors=True)
    sizes = {**checkpoint_sizes(experts), "moe_intermediate_size": moe_intermediate}
    make_tiny_kimi_k3(tmp, max_shard_size=shard_mb * 2**20, whole_experts=whole_experts, **sizes)
    tmp.rename(path)
    return path


def shards(ckpt: Path) -> list[Path]:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    return [ckpt / f for f in sorted(set(index["weight_map"].values()))]


def read_all(paths: list[Path]) -> None:
    buf = bytearray(CHUNK)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def plain_copy(paths: list[Path], dst: Path, *, fsync: bool, sha256: bool = False) -> float:
    """Read and write every shard in 64 MiB chunks (fsync each file when ``fsync``; ``sha256``: hash every
    chunk too, the one pass over the bytes the converter's resume records need); seconds."""
    import hashlib

    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f, open(dst / p.name, "wb", buffering=0) as g:
            while n := f.readinto(buf):
                if sha256:
                    hashlib.sha256(view[:n]).digest()
                g.write(view[:n])
            if fsync:
                os.fsync(g.fileno())
    return time.perf_counter() - t0


def convert_once(ckpt: Path, dst: Path) -> tuple[float, dict]:
    from modelopt_k3.convert import convert_checkpoint

    shutil.rmtree(dst, ignore_errors=True)
    t0 = time.perf_counter()
    report = convert_checkpoint(ckpt, dst, RECIPE)
    return time.perf_counter() - t0, report.stats.to_dict()


def timed_cpu(fn, *args, **kwargs) -> tuple[object, float]:
    """``fn``'s result and the CPU seconds it took (what bounds a run once the cores are busy)."""
    before = time.process_time()  # this process, every thread, user + system
    result = fn(*args, **kwargs)
    return result, time.process_time() - before


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def child_memory(ckpt: Path, dst: Path) -> None:
    """Run in a fresh process: RSS after imports and planning, and the peak RSS while converting.

    The peak is the kernel's VmHWM, reset after planning (``clear_refs`` 5) so that neither the
    imports nor the parent's memory (``ru_maxrss`` survives fork and exec on Linux) count.
    """
    import modelopt_k3.convert as conv
    from modelopt_k3.recipe import load_recipe

    recipe = load_recipe(RECIPE)
    conv._build_plan(ckpt.absolute(), recipe)  # imports and numerics tables warmed
    shutil.rmtree(dst, ignore_errors=True)
    Path("/proc/self/clear_refs").write_text("5")
    baseline = _status_bytes("VmRSS")
    conv.convert_checkpoint(ckpt, dst, recipe)
    peak = _status_bytes("VmHWM")
    print(json.dumps({"baseline_rss": baseline, "peak_rss": peak}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "modelopt_k3_bench")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--shard_mb", type=int, default=256)
    p.add_argument("--size", choices=("default", "multi-gb"), default="default",
                   help="multi-gb: the ~2.2 GB checkpoint bench_convert_peer.py uses (overrides --experts/--shard_mb)")
    p.add_argument("--child", nargs=2, metavar=("CKPT", "DST"), help=argparse.SUPPRESS)
    p.add_argument("--no_write", action="store_true", help="print the results without writing convert.json")
    args = p.parse_args(argv)
    if args.child:
        child_memory(Path(args.child[0]), Path(args.child[1]))
        return 0

    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.size == "multi-gb":
        ckpt = build_checkpoint(args.workdir, **MULTI_GB)
        args.experts, args.shard_mb = MULTI_GB["experts"], MULTI_GB["shard_mb"]
    else:
        ckpt = build_checkpoint(args.workdir, args.experts, args.shard_mb)
    build_s = time.perf_counter() - t0
    paths = shards(ckpt)
    total = sum(p.stat().st_size for p in paths)
    largest = max(p.stat().st_size for p in paths)
    print(f"checkpoint {ckpt}: {len(paths)} shards, {total / 2**20:.0f} MiB, largest {largest / 2**20:.0f} MiB "
          f"(built/cached in {build_s:.1f}s)")

    import modelopt_k3.convert as conv
    from modelopt_k3.recipe import load_recipe

    conv._build_plan(ckpt.absolute(), load_recipe(RECIPE))  # imports outside the timings
    read_all(paths)  # both measurements read from a warm page cache
    plain_copy(paths, args.workdir / "copy_out", fsync=True)  # untimed warm-up of both sides
    convert_once(ckpt, args.workdir / "convert_out")
    copy_s, copy_nosync_s, copy_hash_s, convert_s = [], [], [], []
    copy_cpu, copy_hash_cpu, convert_cpu = [], [], []
    stats: dict = {}
    load_before = os.getloadavg()
    for i in range(args.repeats):
        seconds, cpu = timed_cpu(plain_copy, paths, args.workdir / "copy_out", fsync=True)
        copy_s.append(seconds)
        copy_cpu.append(cpu)
        copy_nosync_s.append(plain_copy(paths, args.workdir / "copy_out", fsync=False))
        seconds, cpu = timed_cpu(plain_copy, paths, args.workdir / "copy_out", fsync=True, sha256=True)
        copy_hash_s.append(seconds)
        copy_hash_cpu.append(cpu)
        (seconds, stats), cpu = timed_cpu(convert_once, ckpt, args.workdir / "convert_out")
        convert_s.append(seconds)
        convert_cpu.append(cpu)
        print(f"  repeat {i}: copy {copy_s[-1]:.2f}s (no fsync {copy_nosync_s[-1]:.2f}s), convert {convert_s[-1]:.2f}s")
    load_after = os.getloadavg()
    copy_med, conv_med = statistics.median(copy_s), statistics.median(convert_s)
    nosync_med = statistics.median(copy_nosync_s)
    copy_min, conv_min, nosync_min = min(copy_s), min(convert_s), min(copy_nosync_s)

    out = subprocess.run(
        [sys.executable, __file__, "--child", str(ckpt), str(args.workdir / "memory_out")],
        check=True, capture_output=True, text=True,
    )
    mem = json.loads(out.stdout.strip().splitlines()[-1])
    shutil.rmtree(args.workdir / "memory_out", ignore_errors=True)

    import torch

    result = {
        "what": "modelopt_k3.convert_checkpoint (Kimi-K3 mirror recipe) vs a plain read-and-write copy of the same shards",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "checkpoint": {"shards": len(paths), "bytes": total, "largest_shard_bytes": largest,
                       "size": args.size, "sizes": checkpoint_sizes(args.experts), "max_shard_mb": args.shard_mb},
        "repeats": args.repeats,
        "load_average_before_after": [load_before, load_after],
        "copy_s": copy_s,
        "copy_no_fsync_s": copy_nosync_s,
        "convert_s": convert_s,
        "copy_sha256_s": copy_hash_s,
        # CPU seconds (all threads): the conversion's over the cores is its wall floor on this machine
        "copy_cpu_s": copy_cpu,
        "copy_sha256_cpu_s": copy_hash_cpu,
        "convert_cpu_s": convert_cpu,
        "throughput_ratio_vs_copy_with_sha256": statistics.median(copy_hash_s) / conv_med,
        "copy_mib_per_s": total / copy_med / 2**20,
        "copy_no_fsync_mib_per_s": total / nosync_med / 2**20,
        "convert_mib_per_s": total / conv_med / 2**20,
        "throughput_ratio": copy_med / conv_med,
        "throughput_ratio_vs_copy_without_fsync": nosync_med / conv_med,
        "throughput_ratio_best_of_repeats": copy_min / conv_min,
        "throughput_ratio_best_of_repeats_vs_copy_without_fsync": nosync_min / conv_min,
        "throughput_goal": ">= 0.6 (vs the fsync'ing copy: the converter fsyncs every shard for resumability)",
        "baseline_rss_bytes": mem["baseline_rss"],
        "peak_rss_bytes": mem["peak_rss"],
        "peak_rss_over_largest_shard": mem["peak_rss"] / largest,
        "conversion_rss_over_largest_shard": (mem["peak_rss"] - mem["baseline_rss"]) / largest,
        "memory_goal": "(peak - baseline) <= 0.5x largest shard (issue 20; was <= 3x)",
        "stats": stats,
        "notes": "page cache warm; the converter fsyncs and sha256-hashes each output shard; the primary copy "
                 "fsyncs each file too, the second copy does not; ratios from medians (and from the best run of "
                 "each, less sensitive to other jobs on a shared machine); baseline = RSS after imports and planning in a fresh process, peak = its VmHWM during the conversion",
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("stats", "machine", "checkpoint")}, indent=2))
    if not args.no_write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
