"""The wall-time model (``memory/wall_time.py``) against measured ``hf_ptq`` runs on this machine (issue 44 item 2).

In one run: this machine's constants are measured in fresh processes (the ``--constants`` and ``--startup``
modes below), then ``hf_ptq`` runs on the tiny Kimi-K3 and a mid-size stand-in (bench_layerwise's sizes), one
process and EP 2, resident and layerwise, each timed from its processes' start to their exit; the model,
fed the measured constants as a ``Hardware``, predicts each. Figure per run: the relative error
``|predicted / measured - 1|``, target 0.3 (within 30%); the ratio itself is in the details.

Per-unit costs (``per_unit_costs``): what a run pays per source tensor loaded, per routed expert called, per tensor
written and per tensor the served check reads back, fitted from two hf_ptq probe runs on checkpoints that differ
from both stand-ins only in their expert count (16 and 96 experts at the tiny widths): each phase's time off the
run's own output lines, less the model's byte and FLOP terms, over the workload's counts; the slope between the
probes cancels what does not grow with the count.

Constants (``--constants``): read (the checkpoint's tensors through ``CheckpointReader``, page cache warm),
MXFP4 decode (``mxfp4_decode``), BF16 GEMM at the model's width, memory streaming (a 64 MB clone), write (64 MB
with fsync), per-module dispatch (a small ``nn.Linear`` call x the model's modules per decoder layer), gloo
all-to-all between two processes. Start-up (``--startup``): a fresh process importing what hf_ptq imports,
loading the tokenizer and building the model on meta — a run's fixed cost before its first weight byte. Ranks
share this machine's cores: each of ``N`` ranks gets ``1/N`` of every CPU rate (the EP runs give each rank
``threads // N`` torch threads). The machine's load average is recorded with the figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .common import Figure, tiny_checkpoint

AREA = "wall_time"
REPO = Path(__file__).resolve().parents[1]
SIZES = {"num_experts": 64, "moe_intermediate_size": 256, "routed_expert_hidden_size": 256, "num_hidden_layers": 8}
CALIB = {"calib_size": 16, "batch_size": 4, "calib_seq": 64}
QUICK_CALIB = {"calib_size": 4, "batch_size": 2, "calib_seq": 16}
MiB = 2**20
PROBES = ({"num_experts": 16}, {"num_experts": 96})
# hf_ptq's output lines that end each phase (rank 0), in run order; the last line printed ends the check.
PHASE_ENDS = {"preflight": "] preflight passed", "load": "] loaded ", "calibration": "] calibrated ",
              "export": "] exported "}


# ------------------------------------------------------------------------------ worker modes (fresh processes)


def _meta_model(ckpt: Path):
    """The checkpoint's model on meta, built as the loader builds it (the spec's shims and class, no bytes)."""
    from modelopt_k3.checkpoint import CheckpointReader, read_config
    from modelopt_k3.checkpoint.source_check import check_experts
    from modelopt_k3.load.pretrained import _build_on_meta, resolve_model_class
    from modelopt_k3.spec import PrepareContext, get_spec
    from modelopt_k3.spec.config import load_dtype

    raw = read_config(ckpt)
    spec = get_spec(raw.get("model_type", ""))
    spec.loading.build(ckpt)
    model_cls, config = resolve_model_class(ckpt, raw, trust_remote_code=True, spec=spec)
    with CheckpointReader(ckpt, view=spec.loading.checkpoint_view) as reader:
        source = check_experts(reader.headers(), raw, spec, reader.stored_name)
        spec.loading.prepare(PrepareContext(model_cls, config, ckpt, packed_experts=source.packed_experts))
        return _build_on_meta(model_cls, config, load_dtype(raw), reader, spec)


def startup(ckpt: Path) -> None:
    """What a run does before its first weight byte, besides the preflight: imports, tokenizer, model on meta."""
    from transformers import AutoTokenizer

    from modelopt_k3.cli import hf_ptq  # noqa: F401
    from modelopt_k3.memory import preflight  # noqa: F401

    AutoTokenizer.from_pretrained(ckpt, trust_remote_code=True)
    _meta_model(ckpt)


def _rate(fn, amount: float, repeats: int = 3) -> float:
    """``amount`` per second of ``fn`` (the fastest of ``repeats`` after one warm-up)."""
    fn()
    best = min(_timed(fn) for _ in range(repeats))
    return amount / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _a2a_worker(rank: int, init: str, nbytes: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    x = torch.zeros(nbytes // 2, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)
    dist.barrier()
    best = min(_timed(lambda: dist.all_to_all_single(y, x)) for _ in range(3))
    if rank == 0:
        Path(out).write_text(json.dumps({"bytes_per_s": nbytes / 2 / best}))  # half of the buffer leaves the rank
    dist.destroy_process_group()


def constants(ckpt: Path, out: Path) -> None:
    """Measure this machine's rates (see the module docstring) and write them as JSON."""
    import tempfile

    import torch
    import torch.multiprocessing as mp

    from modelopt_k3.checkpoint import CheckpointReader
    from modelopt_k3.numerics.mxfp4 import mxfp4_decode

    rec: dict[str, float] = {}
    with CheckpointReader(ckpt, check_values=False) as reader:
        names = list(reader.names())
        nbytes = sum(reader.get(n).numel() * reader.get(n).element_size() for n in names)
        rec["read_bytes_per_s"] = _rate(lambda: [reader.get(n) for n in names], nbytes)
    codes = torch.randint(0, 256, (64 * 512, 128), dtype=torch.uint8)
    scales = torch.full((64 * 512, 8), 127, dtype=torch.uint8)
    rec["decode_bytes_per_s"] = _rate(lambda: mxfp4_decode(codes, scales), codes.numel() * 2 * 2)
    model = _meta_model(ckpt)
    text = getattr(model.config, "text_config", model.config)
    hidden = int(text.hidden_size)
    a = torch.randn(CALIB["batch_size"] * CALIB["calib_seq"], hidden, dtype=torch.bfloat16)
    w = torch.randn(hidden, 4 * hidden, dtype=torch.bfloat16)
    rec["gemm_flop_per_s"] = _rate(lambda: a @ w, 2.0 * a.shape[0] * hidden * 4 * hidden)
    big = torch.empty(64 * MiB // 2, dtype=torch.bfloat16).normal_()
    rec["mem_bytes_per_s"] = _rate(big.clone, 64 * MiB)
    payload = os.urandom(64 * MiB)

    def write() -> None:
        with tempfile.NamedTemporaryFile(dir=ckpt.parent) as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())

    rec["write_bytes_per_s"] = _rate(write, 64 * MiB)
    layers = int(text.num_hidden_layers)
    modules_per_layer = sum(1 for _ in model.modules()) / layers
    lin, x = torch.nn.Linear(16, 16), torch.randn(1, 16)
    with torch.no_grad():
        per_call = 1 / _rate(lambda: [lin(x) for _ in range(1000)], 1000)
    rec["layer_forward_s"] = per_call * modules_per_layer
    with tempfile.TemporaryDirectory() as tmp:
        init, result = f"file://{tmp}/init", f"{tmp}/a2a.json"
        mp.start_processes(_a2a_worker, args=(init, 16 * MiB, result), nprocs=2, start_method="spawn")
        rec["a2a_bytes_per_s"] = json.loads(Path(result).read_text())["bytes_per_s"]
    out.write_text(json.dumps(rec))


# ------------------------------------------------------------------------------ the area


def _python(args: list[str], timeout: float, threads: int, env: dict | None = None) -> float:
    """Wall seconds of a fresh ``python`` running ``args`` (raises with its output on failure)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed: {(proc.stdout + proc.stderr)[-3000:]}")
    return wall


def _hf_ptq(ckpt: Path, export: Path, world: int, layerwise: bool, calib: dict,
            threads: int) -> tuple[float, dict[str, float]]:
    """Wall seconds of one hf_ptq run, ``world`` processes (torchrun's environment), start to the last exit, and
    its own phase timers."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["-m", "modelopt_k3.cli.hf_ptq", "--pyt_ckpt_path", str(ckpt), "--trust_remote_code", "--export_path",
            str(export), "--overwrite", "--no_progress", "--uncovered_experts", "shared",
            *[f"--{k}={v}" for k, v in calib.items()], "--report", "none", *(["--layerwise"] if layerwise else [])]
    # no report on either side: the model predicts load, calibration and export (a layerwise run writes the report
    # too since decision 0003; it was timed there and not on the resident side)
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, threads // world)), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    procs = []
    for rank in range(world):
        extra = dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) if world > 1 else {}
        procs.append(subprocess.Popen([sys.executable, *argv], cwd=REPO, env={**env, **extra},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    marks = _line_times(procs[0], t0)
    outs = [marks.pop("output")] + [p.communicate(timeout=1200)[0].decode(errors="replace") for p in procs[1:]]
    procs[0].wait(timeout=1200)
    wall = time.perf_counter() - t0
    if any(p.returncode for p in procs):
        raise RuntimeError(f"hf_ptq world {world} layerwise={layerwise} failed: {outs[0][-3000:]}")
    return wall, {**_own_timers(outs[0]), **marks}


def _line_times(proc: subprocess.Popen, t0: float) -> dict:
    """Rank 0's output as it arrives: when each phase's closing line came (``PHASE_ENDS``, seconds since ``t0``),
    each phase's seconds between them (``*_lines_s``; ``check_lines_s``: the export's line to the last line),
    and the whole ``output``."""
    lines, at = [], {}
    for raw in proc.stdout:
        now = time.perf_counter() - t0
        line = raw.decode(errors="replace")
        lines.append(line)
        at.update({phase: now for phase, text in PHASE_ENDS.items() if text in line and phase not in at})
        at["last"] = now
    out: dict = {"output": "".join(lines)}
    order = [*PHASE_ENDS, "last"]
    for before, phase in zip(order, order[1:]):
        if before in at and phase in at:
            out[f"{'check' if phase == 'last' else phase}_lines_s"] = at[phase] - at[before]
    return out


def _own_timers(text: str) -> dict[str, float]:
    """hf_ptq's own phase timers (rank 0's lines): where a miss lies, phase by phase."""
    import re

    found = {}
    for phase, pattern in (("load_and_build_s", r"\] loaded .* in ([0-9.]+)s"),
                           ("calibration_s", r"\] calibrated on .* in ([0-9.]+)s"),
                           ("export_s", r"\] exported .* in ([0-9.]+)s \(total"),
                           ("timed_total_s", r"\(total ([0-9.]+)s\)"),
                           ("layerwise_total_s", r"\] exported .* layerwise in ([0-9.]+)s")):
        m = re.search(pattern, text)
        if m:
            found[phase] = float(m.group(1))
    return found


def host_hardware(rec: dict, startup_s: float, world: int, units: dict | None = None):
    """This machine as a ``Hardware`` for a run of ``world`` ranks sharing its cores (each gets 1/world of every
    rate); ``units``: the per-unit costs (``per_unit_costs``), paid on one core each, slower only where the ranks
    outnumber the cores."""
    from modelopt_k3.memory.hardware import Hardware

    share = 1 / world
    crowding = max(1.0, world / (os.cpu_count() or 1))
    units = {k: v * crowding for k, v in (units or {}).items()}
    return Hardware(
        name=f"this host ({world} rank(s))", memory_bytes=0, gpus_per_host=world, nvlink_domain=world,
        gemm_flop_per_s=rec["gemm_flop_per_s"] * share, hbm_bytes_per_s=rec["mem_bytes_per_s"] * share,
        host_link_bytes_per_s=float("inf"), intra_node_bytes_per_s=rec["a2a_bytes_per_s"],
        inter_node_bytes_per_s=rec["a2a_bytes_per_s"], host_disk_read_bytes_per_s=rec["read_bytes_per_s"],
        host_disk_write_bytes_per_s=rec["write_bytes_per_s"], process_read_bytes_per_s=rec["read_bytes_per_s"] * share,
        process_write_bytes_per_s=rec["write_bytes_per_s"] * share, decode_bytes_per_s=rec["decode_bytes_per_s"] * share,
        search_bytes_per_s=rec["mem_bytes_per_s"] * share, factor_flop_per_s=rec["gemm_flop_per_s"] * share,
        startup_s=startup_s, layer_forward_s=rec["layer_forward_s"] / share, source="measured in this run", **units)


def _workload(ckpt: Path, world: int, layerwise: bool, calib: dict):
    """The ``Workload`` of the hf_ptq run, with its plan as hf_ptq makes it on this host."""
    from modelopt_k3.memory.inventory import read_layout
    from modelopt_k3.memory.planner import Asked, RunShape, planned
    from modelopt_k3.memory.wall_time import workload_of
    from modelopt_k3.recipe import load_recipe

    layout = read_layout(ckpt)
    recipe = load_recipe(layout.spec.recipes.qformat.get("nvfp4", "presets/nvfp4"))
    shape = RunShape(calib["batch_size"], calib["calib_seq"], recipe.name, "cpu", None, layerwise)
    plan = planned(layout, Asked("whole" if world == 1 else "expert_parallel", "replicated", "bf16", world), shape)
    return workload_of(layout, plan, recipe=recipe, calib_size=calib["calib_size"], batch_size=calib["batch_size"],
                       calib_seq=calib["calib_seq"], layerwise=layerwise, table=layout.decision_table(recipe))


def predicted(ckpt: Path, rec: dict, startup_s: float, world: int, layerwise: bool, calib: dict,
              units: dict | None = None):
    """The model's wall time of the hf_ptq run on this host's measured constants and per-unit costs."""
    from modelopt_k3.memory.wall_time import predict

    return predict(_workload(ckpt, world, layerwise, calib), host_hardware(rec, startup_s, world, units))


# Each per-unit cost: the hf_ptq phase it is fitted on (its lines' seconds), the model's phase whose byte and FLOP
# terms come off first, the workload count it multiplies, and the model's term it fills (zero while fitting).
UNIT_FITS = {
    "tensor_load_s": ("load_lines_s", "load", "source_tensors", "per-tensor overhead"),
    "expert_call_s": ("calibration_lines_s", "calibration", "expert_calls", "per-expert dispatch"),
    "tensor_export_s": ("export_lines_s", "export", "output_tensors", "per-tensor overhead"),
    "tensor_check_s": ("check_lines_s", "export", "checked_tensors", "served check"),
}


def per_unit_costs(ctx, rec: dict, calib: dict) -> tuple[dict, dict]:
    """The per-unit costs (module docstring), fitted on the ``PROBES`` (the faster of two runs each), and what
    they were fitted from."""
    from modelopt_k3.memory.wall_time import predict

    probes = []
    for sizes in PROBES:
        ckpt = tiny_checkpoint(ctx.workdir, ctx.log, **sizes)
        _, marks = min((_hf_ptq(ckpt, ctx.workdir / "wall_time_probe", 1, False, calib, ctx.threads)
                        for _ in range(2)), key=lambda run: run[0])
        work = _workload(ckpt, 1, False, calib)
        bytes_only = predict(work, host_hardware(rec, 0.0, 1))  # no per-unit costs yet: their residual
        probes.append((marks, work, bytes_only))
    units, fitted = {}, {}
    for unit, (measured, phase, count, term) in UNIT_FITS.items():
        residuals, counts = [], []
        for marks, work, bytes_only in probes:
            # the check's lines are the check alone; the other phases less the model's other terms
            other = 0.0 if unit == "tensor_check_s" else (bytes_only.seconds(phase)
                                                         - bytes_only.phases[phase].terms.get(term, 0.0))
            residuals.append(marks[measured] - other)
            counts.append(getattr(work, count))
        units[unit] = max(0.0, (residuals[1] - residuals[0]) / (counts[1] - counts[0]))
        fitted[unit] = {"probe_seconds": [m[measured] for m, _, _ in probes], "residual_s": residuals, count: counts}
    return units, fitted


def run(ctx):
    calib = QUICK_CALIB if ctx.quick else CALIB
    stand_ins = {"tiny Kimi-K3": tiny_checkpoint(ctx.workdir, ctx.log)}
    if not ctx.quick:
        stand_ins["mid-size Kimi-K3 (64 experts x 8 layers)"] = tiny_checkpoint(ctx.workdir, ctx.log, **SIZES)
    load = {"before": os.getloadavg()}
    figures, runs = [], {}
    units = fitted = None
    for label, ckpt in stand_ins.items():
        out = ctx.workdir / "wall_time_constants.json"
        _python(["-m", "benchmarks.bench_wall_time", "--constants", str(ckpt), str(out)], 600, ctx.threads)
        rec = json.loads(out.read_text())
        if units is None:
            units, fitted = per_unit_costs(ctx, rec, calib)
            ctx.log(f"wall_time per-unit costs (ms): {', '.join(f'{k} {v * 1e3:.3f}' for k, v in units.items())}")
        start = min(_python(["-m", "benchmarks.bench_wall_time", "--startup", str(ckpt)], 600, ctx.threads)
                    for _ in range(2))
        for world in (1, 2):
            for layerwise in (False, True):
                mode = "layerwise" if layerwise else "resident"
                wall, own = _hf_ptq(ckpt, ctx.workdir / "wall_time_export", world, layerwise, calib, ctx.threads)
                t = predicted(ckpt, rec, start, world, layerwise, calib, units)
                ratio = t.total / wall
                name = f"wall_time_{'tiny' if label.startswith('tiny') else 'mid'}_ep{world}_{mode}"
                ctx.log(f"{name}: predicted {t.total:.1f}s, measured {wall:.1f}s ({ratio:.2f})")
                runs[name] = {"measured_s": wall, "hf_ptq_timers": own, "predicted": t.as_dict(), "constants": rec, "startup_s": start,
                              "terms": {p.name: p.terms for p in t.phases.values()}}
                figures.append(Figure(
                    name, AREA, f"hf_ptq wall time, model vs measured, relative error ({label}, {world} "
                                f"process(es), {mode}; predicted / measured {ratio:.2f})",
                    {"label": "the wall-time model with this run's measured constants", "value": t.total, "unit": "s"},
                    {"label": "hf_ptq's processes, start to exit", "value": wall, "unit": "s"}, abs(ratio - 1),
                    target=0.3, target_text="|predicted / measured - 1| <= 0.3 (within 30%)", higher_is_better=False,
                    unit="",
                    details={"predicted_over_measured": ratio, "bottleneck": t.bottleneck, "hf_ptq_timers": own},
                    bound="the per-unit costs are fitted at the tiny widths (a wider expert's calibration costs "
                          "more per call on a CPU: small GEMMs below the streaming rate), the fixed start-up is "
                          "measured apart from the run, and the EP runs share this host's cores with each other "
                          "and anything else running (compare the details' hf_ptq phases with the terms)"))
    load["after"] = os.getloadavg()
    return figures, {"calibration": calib, "load_average": load, "runs": runs, "per_unit_costs": units,
                     "per_unit_fit": fitted}


if __name__ == "__main__":
    if sys.argv[1] == "--constants":
        constants(Path(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1] == "--startup":
        startup(Path(sys.argv[2]))
