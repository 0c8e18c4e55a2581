"""hf_ptq's memory check, one of the preflight checks (``modelopt_k3.run.preflight``): before any weight is
read, the planner's verdict on the run's distribution plan."""

from __future__ import annotations

import torch

from ..run.preflight import PreflightContext, register_check
from .inventory import layout_of
from .planner import RunShape, fit_plan


@register_check("memory plan fits", after="layerwise")
def memory_plan_fits(ctx: PreflightContext) -> None:
    """Refuse a run that cannot fit (``MemoryPlanError``: the numbers and a configuration that would); else
    set the run's experts residency on its distribution plan (``--experts auto`` resolved: packed when bf16
    does not fit) with the decode chunk, and keep the estimate in ``ctx.memory``. The budget is
    ``--gpu_mem_gib``, else the accelerator's memory, else host RAM per local rank. The layout is read off
    the preflight's one reader (no header is read again)."""
    cfg = ctx.config
    ctx.layout = layout_of(ctx.reader, ctx.raw_config, ctx.spec, ctx.source)
    shape = RunShape(cfg.batch_size, cfg.calib_seq, ctx.recipe.name, "cuda" if torch.cuda.is_available() else "cpu",
                     ctx.dtype, layerwise=ctx.layerwise is not None)  # the plan's dtype, decided once
    ctx.distribution, ctx.memory = fit_plan(ctx.layout, ctx.distribution, cfg.experts, shape, recipe=ctx.recipe,
                                            gpu_mem_gib=cfg.gpu_mem_gib)
