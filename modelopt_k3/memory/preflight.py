"""hf_ptq's memory check, one of the preflight checks (``modelopt_k3.preflight``): before any weight is
read, the planner's verdict on the run the command line asks for."""

from __future__ import annotations

import torch

from ..preflight import PreflightContext, register_check
from .planner import check_fits


@register_check("memory plan fits", after="calibration data")
def memory_plan_fits(ctx: PreflightContext) -> None:
    """Refuse a run that cannot fit (``MemoryPlanError``: the numbers and a configuration that would); else
    keep the planner's estimate in ``ctx.memory``: its residency resolves ``--experts auto`` and its decode
    chunk is the load's. The budget is ``--gpu_mem_gib``, else the accelerator's memory, else host RAM per
    local rank."""
    args = ctx.args
    ctx.memory = check_fits(
        ctx.checkpoint, plan=args.plan, world_size=ctx.world_size, dense=args.dense, ep_degree=args.ep_degree,
        experts=args.experts, gpu_mem_gib=args.gpu_mem_gib, batch_size=args.batch_size, calib_seq=args.calib_seq,
        recipe=ctx.recipe, device="cuda" if torch.cuda.is_available() else "cpu",
        dtype=getattr(torch, args.dtype) if args.dtype else None,
    )
