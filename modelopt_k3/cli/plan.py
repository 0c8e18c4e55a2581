"""``modelopt-k3-plan``: per-rank memory of every plan x experts residency, from the headers alone.

    modelopt-k3-plan --pyt_ckpt_path CKPT --world_size N [--gpu_mem_gib G] [--batch_size B --calib_seq S]
                     [--qformat Q | --recipe R] [--device cuda|cpu] [--layerwise] [--json]
                     [--time [--hardware PRESET] [--calib_size N] [--disk_gbps R] [--disk_write_gbps W] [--net_gbps N]]

Reads ``config.json`` and the safetensors headers (no tensor bytes, no model), prints the table, the
smallest world size each configuration fits on, and each configuration's largest per-rank module. Exits 1 when no
configuration fits ``N`` ranks (so a launcher script can stop early), else 0. ``--time`` adds each
configuration's predicted wall time (load, calibration, export, total, each with its bottleneck;
``memory/wall_time.py``) on a hardware preset (``memory/hardware.py``), a second table or a ``time`` object per
JSON row.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._common import positive_float, positive_int, run_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="modelopt-k3-plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--pyt_ckpt_path", type=Path, required=True, help="checkpoint directory (headers are read)")
    p.add_argument("--world_size", type=positive_int, required=True, help="ranks (GPUs) the run would use")
    p.add_argument("--gpu_mem_gib", type=positive_float, default=None,
                   help="memory per rank (default: this machine's accelerator, or host RAM / ranks with --device cpu)")
    p.add_argument("--batch_size", type=positive_int, default=4, help="calibration sequences per batch per rank")
    p.add_argument("--calib_seq", type=positive_int, default=2048, help="tokens per calibration sequence")
    p.add_argument("--qformat", default="nvfp4",
                   help="what hf_ptq --qformat would quantize with: a preset name, mapped to this model's own recipe "
                        "as hf_ptq maps it (default nvfp4)")
    p.add_argument("--recipe", default=None, help="recipe name or path (overrides --qformat)")
    p.add_argument("--layerwise", action="store_true",
                   help="plan hf_ptq --layerwise runs: one decoder layer resident at a time (FSDP2 plans refused)")
    p.add_argument("--json", action="store_true",
                   help="print a JSON list, one object per row (plan, experts, layerwise, world_size, peak_gib, fits, "
                        "refused, smallest_world), instead of the table")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda: plan accelerator memory (the default, also on a machine without one); cpu: host RAM")
    _add_time_flags(p)
    return p


def _add_time_flags(p: argparse.ArgumentParser) -> None:
    """``--time``: the wall-time plan (``memory/wall_time.py``) and the hardware it is priced on."""
    from ..memory.hardware import PRESETS

    p.add_argument("--time", action="store_true",
                   help="also predict each configuration's wall time (load, calibration, export, total) and name "
                        "each phase's bottleneck")
    p.add_argument("--hardware", default="h200-node", choices=sorted(PRESETS),
                   help="hardware preset the times are priced on (default h200-node; memory/hardware.py cites "
                        "the datasheets)")
    p.add_argument("--calib_size", type=positive_int, default=32,
                   help="calibration sequences in all, as hf_ptq --calib_size (default 32)")
    p.add_argument("--disk_gbps", type=positive_float, default=None,
                   help="storage read GB/s per host (caps one process's read too); default: the preset's")
    p.add_argument("--disk_write_gbps", type=positive_float, default=None,
                   help="storage write GB/s per host (caps one process's write too); default: the preset's")
    p.add_argument("--net_gbps", type=positive_float, default=None,
                   help="inter-node GB/s per rank, one direction (EP groups beyond the NVLink domain); "
                        "default: the preset's")


def main(argv: list[str] | None = None) -> int:
    """Arguments are checked by the parser (exit 2); a checkpoint, recipe or plan the planner refuses is one line
    on stderr, exit 2 (``run_cli``), before any work."""
    args = build_parser().parse_args(argv)
    return run_cli("modelopt-k3-plan", lambda: _plan(args))


def _plan(args: argparse.Namespace) -> int:
    from ..checkpoint import read_config
    from ..memory.planner import plan_memory
    from ..run.plan import recipe_name
    from ..spec import get_spec

    spec = get_spec(read_config(args.pyt_ckpt_path).get("model_type", ""))
    report = plan_memory(args.pyt_ckpt_path, world_size=args.world_size, gpu_mem_gib=args.gpu_mem_gib,
                         batch_size=args.batch_size, calib_seq=args.calib_seq,
                         recipe=recipe_name(spec, args.qformat, args.recipe), device=args.device,
                         layerwise=args.layerwise)
    times = _times(report, args) if args.time else None
    if args.json:
        import json

        print(json.dumps(report.rows() if times is None else times.rows(), indent=1))
    else:
        print(report.table())
        if times is not None:
            print("\n" + times.table())
    at_world = [e for e in report.estimates if e.asked.world_size == args.world_size or args.world_size == 1]
    return 0 if report.budget is None or any(e.fits(report.budget) for e in at_world) else 1


def _times(report, args: argparse.Namespace):
    """``--time``: the memory report's configurations priced on ``--hardware`` with the overrides."""
    from ..memory.hardware import get_hardware
    from ..memory.wall_time import time_plan

    hw = get_hardware(args.hardware).with_overrides(disk_gbps=args.disk_gbps, disk_write_gbps=args.disk_write_gbps,
                                                    net_gbps=args.net_gbps)
    return time_plan(report, hw, args.calib_size)


if __name__ == "__main__":
    sys.exit(main())
