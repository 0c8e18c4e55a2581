"""``modelopt-k3-plan``: per-rank memory of every plan x experts residency, from the headers alone.

    modelopt-k3-plan --pyt_ckpt_path CKPT --world_size N [--gpu_mem_gib G] [--batch_size B --calib_seq S]
                     [--qformat Q | --recipe R] [--device cuda|cpu] [--layerwise] [--json]

Reads ``config.json`` and the safetensors headers (no tensor bytes, no model), prints the table, the
smallest world size each configuration fits on, and each configuration's largest per-rank module. Exits 1 when no
configuration fits ``N`` ranks (so a launcher script can stop early), else 0.
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
    return p


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
    if args.json:
        import json

        print(json.dumps(report.rows(), indent=1))
    else:
        print(report.table())
    at_world = [e for e in report.estimates if e.asked.world_size == args.world_size or args.world_size == 1]
    return 0 if report.budget is None or any(e.fits(report.budget) for e in at_world) else 1


if __name__ == "__main__":
    sys.exit(main())
