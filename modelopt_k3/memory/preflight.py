"""hf_ptq's memory checks, two of the preflight checks (``modelopt_k3.run.preflight.CHECKS`` lists them):
before any weight is read, the planner's verdict on the run's distribution plan, and its predicted wall time."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..run.planning import plan_memory
from .planner import RunShape

if TYPE_CHECKING:
    from ..run.preflight import PreflightContext


def memory_plan_fits(ctx: PreflightContext) -> None:
    """Refuse a run that cannot fit (``MemoryPlanError``: the numbers and a configuration that would); else
    set the run's experts residency on its distribution plan (``--experts auto`` resolved: packed when bf16
    does not fit) with the decode chunk, and keep the estimate in ``ctx.memory``. The budget is
    ``--gpu_mem_gib``, else the accelerator's memory, else host RAM per local rank. The layout is read off
    the preflight's one reader (no header is read again)."""
    # The step a library load takes too (``run.planning.plan_memory``), on the run's dtype and table.
    ctx.layout, ctx.distribution, ctx.memory = plan_memory(
        ctx.config, reader=ctx.reader, raw=ctx.raw_config, spec=ctx.spec, source=ctx.source, recipe=ctx.recipe,
        table=ctx.table, distribution=ctx.distribution, dtype=ctx.dtype, layerwise=ctx.layerwise is not None)


def predicted_wall_time(ctx: PreflightContext) -> None:
    """A note with the run's predicted wall time (``wall_time.py``) on the hardware preset ``--hardware`` names
    (the run's config), by default ``h200-node`` on a CUDA device; on a CPU none (no preset describes a host's
    cores: the benchmark measures them). Refuses nothing: an unknown preset name is said in the note."""
    from .hardware import get_hardware
    from .wall_time import predict_run

    name = ctx.config.hardware or ("h200-node" if torch.cuda.is_available() else None)
    if name is None:
        return
    try:
        hardware = get_hardware(name)
    except ValueError as err:
        ctx.notes.append(f"no wall-time prediction: --hardware: {err}")
        return
    cfg = ctx.config
    shape = RunShape(cfg.batch_size, cfg.calib_seq, ctx.recipe.name, "cuda", ctx.dtype,  # the plan's dtype
                     layerwise=ctx.layerwise is not None)
    t = predict_run(ctx.layout, ctx.distribution, shape, recipe=ctx.recipe, calib_size=cfg.calib_size,
                    hardware=hardware, table=ctx.table)
    phases = ", ".join(f"{n} {p.seconds:.0f}s" for n, p in t.phases.items())
    ctx.notes.append(f"predicted wall time on {hardware.name}: {t.total:.0f}s ({phases}; bottleneck {t.bottleneck}; "
                     "first-order, modelopt-k3-plan --time shows the terms)")
