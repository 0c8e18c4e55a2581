"""Expert-parallel PTQ per rank at EP 1, 2 and 4 (issue 4's benchmark), gloo on CPU.

The checkpoint is the tiny Kimi-K3 with 64 experts per MoE layer and 256x256 expert matrices, so
the routed experts are most of the bytes. Each EP degree runs the whole ``hf_ptq`` pipeline -- load
(``plan="auto"``: whole at EP 1, expert_parallel above), NVFP4 calibration on the builtin text (the
same sequences split across ranks), export -- in fresh processes launched like ``torchrun`` (one
process per rank, ``RANK``/``WORLD_SIZE``/``MASTER_*`` set; ``OMP_NUM_THREADS`` = threads / ranks).

Per rank it records: checkpoint bytes read in each phase, split routed-expert / dense (every
``CheckpointReader.get`` is counted, including the export's re-read of the experts' MXFP4 source
for the lossless cast); the bytes of the local fused expert parameters; resident memory (RSS)
after imports, after load, after calibration and after export, and the peak (kernel VmHWM, reset
at each phase start) during load, calibration and export; wall time of each phase.

Goals (issue 4): expert bytes read and expert memory per rank scale as 1/EP (checked as
``EP1 bytes / (EP x largest rank's bytes) >= 1``). Export peak memory over the high-water mark at the
end of calibration is reported at this size, and (issue 12) checked <= 1.05 on a larger checkpoint whose
every rank writes more than the shard writer keeps in memory (``_export_peak_past_spill``).
Wall times at EP > 1 share 2 cores between the ranks: they show overheads, not speed-ups.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from modelopt_k3.export.writer import DEFAULT_SPILL_BYTES

from .bench_io import QUICK_SMALL as QUICK_SIZES
from .bench_io import SMALL as SIZES
from .common import Figure, PeakRSS, _status_kib, rss_now, tiny_checkpoint

AREA = "ep"
REPO = Path(__file__).resolve().parent.parent
CALIB = {"sequences": 16, "seq_len": 64, "batch_size": 4}
PAST_SPILL_SIZES = {"num_experts": 128, "moe_intermediate_size": 1024, "routed_expert_hidden_size": 1024,
                    "num_hidden_layers": 6}
PAST_SPILL_CALIB = {"sequences": 8, "seq_len": 32, "batch_size": 4}
QUICK_CALIB = {"sequences": 4, "seq_len": 16, "batch_size": 2}


# ------------------------------------------------------------------------------------ rank worker


def worker(ckpt: str, export_dir: str, out_json: str, calib: dict) -> None:
    """One rank: load -> calibrate -> export, measured; writes its record to ``out_json``.

    ``calib``: the calibration loop's sizes, plus optionally ``experts`` (the residency asked of
    ``load_pretrained``, default ``auto``) and ``time_decode`` (time every packed-experts decode).
    """
    hwm_start = (_status_kib("VmHWM") or 0) * 1024
    from modelopt_k3.checkpoint import CheckpointReader
    from modelopt_k3.models.kimi_k3.converters import EXPERT_KEY_RE

    phase = ["load"]
    reads: dict[str, dict[str, int]] = {}
    original_get = CheckpointReader.get

    def counting_get(self, key):
        tensor = original_get(self, key)
        r = reads.setdefault(phase[0], {"expert_bytes": 0, "dense_bytes": 0, "keys": 0})
        r["expert_bytes" if EXPERT_KEY_RE.match(key) else "dense_bytes"] += self.info(key).nbytes
        r["keys"] += 1
        return tensor

    CheckpointReader.get = counting_get
    try:
        rec = _measured_pipeline(ckpt, export_dir, calib, phase, hwm_start)
    finally:
        CheckpointReader.get = original_get
    rec["reads"] = reads
    rec["expert_bytes_read"] = sum(r["expert_bytes"] for r in reads.values())
    rec["dense_bytes_read"] = sum(r["dense_bytes"] for r in reads.values())
    Path(out_json).write_text(json.dumps(rec, indent=2))


def _measured_pipeline(ckpt: str, export_dir: str, calib: dict, phase: list[str], hwm_start: int) -> dict:
    from modelopt_k3 import export_checkpoint, load_pretrained, quantize
    from modelopt_k3.dist.group import run_group
    from modelopt_k3.experts import packed as packed_experts
    from modelopt_k3.recipe import load_recipe

    from .common import calibration_loop

    calib = dict(calib)
    experts_residency, time_decode = calib.pop("experts", "auto"), calib.pop("time_decode", False)
    rec: dict = {"rss_after_imports": rss_now(), "decode_s": 0.0, "decodes": 0}
    if time_decode:  # every decode of packed experts into the workspace, timed
        real_decode = packed_experts.mxfp4_decode

        def timed_decode(*a, **k):
            t = time.perf_counter()
            out = real_decode(*a, **k)
            rec["decode_s"] += time.perf_counter() - t
            rec["decodes"] += 1
            return out

        packed_experts.mxfp4_decode = timed_decode
    hwm_start = max(hwm_start, (_status_kib("VmHWM") or 0) * 1024)
    with run_group() as group:
        rec.update(rank=group.rank, world_size=group.world_size)
        t0 = time.perf_counter()
        with PeakRSS() as peak:
            model = load_pretrained(ckpt, plan="auto", trust_remote_code=True, progress=False, experts=experts_residency)
        rec["load_s"] = time.perf_counter() - t0
        rec["load_peak_rss"], rec["rss_after_load"] = peak.peak, rss_now()
        info = model.modelopt_k3
        rec["plan"] = info.plan.describe()
        rec["experts_residency"] = info.plan.experts_residency
        rec["bytes_read_by_loader"] = info.bytes_read
        experts = [m for n, m in model.named_modules() if info.spec.is_experts_module(n, m)]
        rec["local_experts_per_layer"] = [m.num_experts for m in experts]
        # Decoded parameters, or the packed codes and scales (buffers).
        rec["expert_param_bytes"] = sum(t.nbytes for m in experts for t in [*m.parameters(), *m.buffers()])
        rec["all_param_bytes"] = sum(p.nbytes for p in model.parameters()) + sum(
            b.nbytes for m in experts for b in m.buffers())

        phase[0] = "calibration"
        loop = calibration_loop(model, Path(ckpt), rank=group.rank, world_size=group.world_size, **calib)
        decode_before = rec["decode_s"]
        t0 = time.perf_counter()
        with PeakRSS() as peak:
            quantize(model, load_recipe("presets/nvfp4"), loop)
        rec["calibration_s"] = time.perf_counter() - t0
        rec["calibration_decode_s"] = rec["decode_s"] - decode_before
        rec["calibration_peak_rss"], rec["rss_after_calibration"] = peak.peak, rss_now()
        rec["hwm_after_calibration"] = max(hwm_start, rec["load_peak_rss"], rec["calibration_peak_rss"])

        phase[0] = "export"
        t0 = time.perf_counter()
        with PeakRSS() as peak:
            export_checkpoint(model, export_dir, overwrite=True, progress=False)
        rec["export_s"] = time.perf_counter() - t0
        rec["export_peak_rss"], rec["rss_after_export"] = peak.peak, rss_now()
    index = json.loads((Path(export_dir) / "model.safetensors.index.json").read_text())
    rec["export_total_bytes"] = index["metadata"]["total_size"]  # all ranks together
    return rec


# ------------------------------------------------------------------------------------ launcher


def start(ep: int, ckpt: Path, workdir: Path, calib: dict, timeout: float, threads: int, tag: str = "") -> dict:
    """Start ``ep`` worker processes (torchrun-style env); ``finish`` waits for them."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = workdir / f"ep{ep}{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    threads = max(1, threads // ep)
    procs = []
    for rank in range(ep):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MODELOPT_K3_DIST_TIMEOUT": str(int(timeout)),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        if ep > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(ep), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(ep),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = open(run_dir / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed in finish
        cmd = [sys.executable, "-m", "benchmarks.bench_ep", "--worker", str(ckpt), str(run_dir / "export"),
               str(run_dir / f"rank{rank}.json"), json.dumps(calib)]
        procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    return {"ep": ep, "run_dir": run_dir, "procs": procs, "deadline": time.monotonic() + timeout,
            "started": time.perf_counter()}


def finish(run: dict) -> list[dict]:
    """Wait for a ``start``ed EP run (killing it at its deadline) and return its records by rank."""
    ep, run_dir = run["ep"], run["run_dir"]
    codes = []
    for p, log in run["procs"]:
        try:
            codes.append(p.wait(timeout=max(1.0, run["deadline"] - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
        log.close()
    if any(codes):
        tails = "\n".join(
            f"--- rank {r} (exit {c}):\n" + (run_dir / f"rank{r}.log").read_text(errors="replace")[-3000:]
            for r, c in enumerate(codes) if c
        )
        raise RuntimeError(f"EP {ep} run failed:\n{tails}")
    records = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(ep)]
    shutil.rmtree(run_dir, ignore_errors=True)
    return records


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _markdown(by_ep: dict[int, list[dict]], sizes: dict, calib: dict) -> str:
    from modelopt_k3.testing import TINY_DEFAULTS

    s = {**TINY_DEFAULTS, **sizes}
    moe_layers = s["num_hidden_layers"] - s["first_k_dense_replace"]
    lines = [
        f"### Expert-parallel PTQ per rank (tiny Kimi-K3: {s['num_experts']} experts x {moe_layers} MoE layers, "
        f"experts {s['moe_intermediate_size']}x{s['routed_expert_hidden_size']}; calibration "
        f"{calib['sequences']} x {calib['seq_len']} tokens; gloo, CPU)",
        "",
        "| EP | rank | expert MiB read | dense MiB read | expert params MiB | RSS after load | peak load | "
        "peak calib | RSS after calib | peak export | load s | calib s | export s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ep, recs in by_ep.items():
        for r in recs:
            lines.append(
                f"| {ep} | {r['rank']} | {_mib(r['expert_bytes_read'])} | {_mib(r['dense_bytes_read'])} | "
                f"{_mib(r['expert_param_bytes'])} | {_mib(r['rss_after_load'])} | {_mib(r['load_peak_rss'])} | "
                f"{_mib(r['calibration_peak_rss'])} | {_mib(r['rss_after_calibration'])} | "
                f"{_mib(r['export_peak_rss'])} | {r['load_s']:.1f} | {r['calibration_s']:.1f} | {r['export_s']:.1f} |"
            )
    lines.append("")
    lines.append("Memory columns are RSS in MiB. Bytes read include the export's re-read of the experts' MXFP4 "
                 "source (lossless cast). Ranks share 2 cores, so times at EP > 1 show overheads, not speed-ups.")
    return "\n".join(lines)


def run(ctx):
    sizes, calib = (QUICK_SIZES, QUICK_CALIB) if ctx.quick else (SIZES, CALIB)
    degrees = (1, 2) if ctx.quick else (1, 2, 4)
    ckpt = tiny_checkpoint(ctx.workdir, ctx.log, **sizes)
    by_ep: dict[int, list[dict]] = {}
    if ctx.quick:  # smoke run, numbers mean nothing: EP 2 in the background, EP 1 in this process meanwhile
        runs = [start(ep, ckpt, ctx.workdir, calib, timeout=300, threads=ctx.threads) for ep in degrees[1:]]
        out = ctx.workdir / "ep1_inprocess.json"
        worker(str(ckpt), str(ctx.workdir / "ep1_inprocess_export"), str(out), calib)
        by_ep[1] = [json.loads(out.read_text())]
        shutil.rmtree(ctx.workdir / "ep1_inprocess_export", ignore_errors=True)
        by_ep.update({run["ep"]: finish(run) for run in runs})
    else:  # one degree at a time: the ranks of one run have the machine to themselves
        for ep in degrees:
            run = start(ep, ckpt, ctx.workdir, calib, timeout=300, threads=ctx.threads)
            by_ep[ep] = finish(run)
            ctx.log(f"ep {ep}: {time.perf_counter() - run['started']:.1f}s wall for {ep} rank(s)")

    figures: list[Figure] = []
    base = by_ep[1][0]
    for ep in degrees[1:]:
        recs = by_ep[ep]
        for what, key, title in (
            ("read", "expert_bytes_read", "expert bytes read per rank"),
            ("memory", "expert_param_bytes", "expert parameter bytes per rank"),
        ):
            worst = max(r[key] for r in recs)
            figures.append(Figure(
                name=f"ep_expert_{what}/ep{ep}", area=AREA, title=f"EP {ep}: {title} x EP vs EP 1",
                ours={"label": f"largest rank's {key} at EP {ep}", "value": worst / 2**20, "unit": "MiB"},
                reference={"label": f"{key} at EP 1", "value": base[key] / 2**20, "unit": "MiB"},
                ratio=base[key] / (ep * worst), target=1.0, target_text=">= 1 (scales as 1/EP)", unit="MiB",
                bound=f"the largest rank's share of the {base[key] / 2**20:.1f} MiB of experts: {ep} ranks own "
                      f"equal blocks of the experts, so the ratio is 1 exactly when no rank {what}s another's",
                details={"per_rank": [r[key] for r in recs],
                         "dense_bytes_read_per_rank": [r["dense_bytes_read"] for r in recs]},
            ))
    for ep in degrees:
        recs = by_ep[ep]
        ratios, r, sides = _export_peak(recs)
        figures.append(Figure(
            name=f"ep_export_peak/ep{ep}", area=AREA,
            title=f"EP {ep}: export peak RSS vs peak after calibration (worst rank)", **sides,
            ratio=max(ratios), target=None,
            target_text="report (was <= 1; the target is now measured past the writer's spill limit)",
            unit="MiB", higher_is_better=False,
            details={"per_rank_ratio": ratios,
                     "export_peak_minus_rss_after_calibration_mib": [
                         (x["export_peak_rss"] - x["rss_after_calibration"]) / 2**20 for x in recs],
                     "export_output_mib_all_ranks": r["export_total_bytes"] / 2**20,
                     "rank": r["rank"],
                     "bound": (
                         f"Export raises rank {r['rank']}'s peak {(r['export_peak_rss'] - r['hwm_after_calibration']) / 2**20:.1f} "
                         f"MiB above its high-water mark after calibration "
                         f"({(r['export_peak_rss'] - r['rss_after_calibration']) / 2**20:.1f} MiB above its RSS then); "
                         f"the whole export writes {r['export_total_bytes'] / 2**20:.1f} MiB over {ep} rank(s). "
                         f"ShardWriter keeps up to {DEFAULT_SPILL_BYTES // 2**20} MiB of a shard in memory before spilling to disk, and the "
                         "lossless cast holds 16 experts' MXFP4 source at a time: at this size a rank's whole "
                         "output fits under both bounds, so it all sits in memory once."
                     )},
        ))
    extra = {"checkpoint": str(ckpt), "sizes": sizes, "calibration": calib, "per_rank": by_ep,
             "markdown": _markdown(by_ep, sizes, calib)}
    if not ctx.quick:
        past, records = _export_peak_past_spill(ctx)
        figures += past
        extra["past_spill_limit"] = records
    return figures, extra


def _export_peak(recs: list[dict]) -> tuple[list[float], dict, dict]:
    """Each rank's export peak over its high-water mark after calibration, the worst rank's record, and
    the figure's two sides for it."""
    ratios = [r["export_peak_rss"] / r["hwm_after_calibration"] for r in recs]
    r = recs[max(range(len(recs)), key=lambda i: ratios[i])]
    sides = {
        "ours": {"label": "export peak RSS", "value": r["export_peak_rss"] / 2**20, "unit": "MiB"},
        "reference": {"label": "RSS high-water mark at the end of calibration",
                      "value": r["hwm_after_calibration"] / 2**20, "unit": "MiB"},
    }
    return ratios, r, sides


def _export_peak_past_spill(ctx) -> tuple[list[Figure], dict]:
    """Export peak vs the peak after calibration where every rank writes more than the writer keeps in memory
    (its spill limit): 128 experts of 1024x1024 in 5 MoE layers, ~1 GiB of NVFP4 experts in all, so even at
    EP 4 a rank writes ~270 MiB, past the limit (64 MiB; it was 256 MiB when this figure was set). Experts are packed (``--experts packed``): bf16 would hold
    3.75 GiB of experts at EP 1, more than this shared machine spares."""
    ckpt = tiny_checkpoint(ctx.workdir, ctx.log, **PAST_SPILL_SIZES)
    figures, records = [], {}
    for ep in (1, 2, 4):
        run = start(ep, ckpt, ctx.workdir, {**PAST_SPILL_CALIB, "experts": "packed"}, timeout=900,
                    threads=ctx.threads, tag="-past-spill")
        recs = finish(run)
        ctx.log(f"ep {ep} past the spill limit: {time.perf_counter() - run['started']:.1f}s")
        records[ep] = recs
        ratios, r, sides = _export_peak(recs)
        per_rank_output = r["export_total_bytes"] / ep  # the experts are ~99% of it, split evenly
        figures.append(Figure(
            name=f"ep_export_peak_past_spill/ep{ep}", area=AREA,
            title=f"EP {ep}: export peak RSS vs peak after calibration, per-rank output past the spill limit",
            **sides,
            # A run whose ranks write less than the spill limit does not measure what this figure is about.
            ratio=max(ratios) if per_rank_output > DEFAULT_SPILL_BYTES else float("inf"),
            target=1.05, target_text="<= 1.05", unit="MiB", higher_is_better=False,
            details={"per_rank_ratio": ratios, "per_rank_output_mib": per_rank_output / 2**20,
                     "spill_limit_mib": DEFAULT_SPILL_BYTES / 2**20,
                     "export_peak_minus_rss_after_calibration_mib": [
                         (x["export_peak_rss"] - x["rss_after_calibration"]) / 2**20 for x in recs],
                     "bound": "export adds the writer's in-memory shard (up to its spill limit) and a "
                              "16-expert cast to what the rank holds; the packed decode workspace is released "
                              "first (export never runs the experts)"},
        ))
    return figures, records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="rank worker of the EP benchmark (started by bench_ep.launch)")
    p.add_argument("--worker", nargs=4, metavar=("CKPT", "EXPORT_DIR", "OUT_JSON", "CALIB_JSON"), required=True)
    args = p.parse_args(argv)
    ckpt, export_dir, out_json, calib = args.worker
    worker(ckpt, export_dir, out_json, json.loads(calib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
