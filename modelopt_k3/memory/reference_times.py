"""The table users want before booking GPUs (docs/MEMORY.md, "How long it takes"): calibrated NVFP4 Kimi-K3 and
DeepSeek-R1 on 1, 8 and 16 GPUs of an H200 or B200 node type, layerwise and resident, from the memory planner
(does it fit, which experts residency) and the wall-time model (how long, what bounds it), with one GPU's
layerwise run as the reference each row's speed-up is taken against.

``reference_table(layouts)`` writes the markdown; ``tests/memory/test_reference_times.py`` checks that the
docs' table equals it, on header-only full-size layouts (``testing.full_size``, which also regenerates it:
``python -m modelopt_k3.testing.full_size DIR``).
"""

from __future__ import annotations

from ..dist.plan import AUTO
from ..recipe import load_recipe
from .hardware import PRESETS, Hardware
from .inventory import CheckpointLayout
from .planner import Asked, GiB, RunShape, fit_plan, planned
from .wall_time import WallTime, _duration, predict_run

WORLDS = (1, 8, 16)
HARDWARE = ("h200-node", "b200-node")
# Calibration: 512 sequences of 2048 tokens (1M tokens) in all; per rank the largest batch that fits.
CALIB_SIZE, CALIB_SEQ, BATCHES = 512, 2048, (4, 2, 1)
HEADER = ("| model | GPUs | mode | configuration | load | calibration | export | total | bottleneck | "
          "vs 1 GPU layerwise |")


def _run(layout: CheckpointLayout, recipe_name: str, world: int, layerwise: bool,
         hw: Hardware) -> tuple[str, WallTime] | None:
    """(configuration, wall time) of the first configuration that fits one GPU's memory (dense replicated, then
    FSDP2-sharded for a resident run; the largest of ``BATCHES``; ``--experts auto``), None when none does."""
    from .planner import MemoryPlanError

    recipe = load_recipe(recipe_name)
    kind = "whole" if world == 1 else "expert_parallel"
    denses = ("replicated",) if layerwise or world == 1 else ("replicated", "fsdp2")
    for dense in denses:
        for batch in BATCHES:
            shape = RunShape(batch, CALIB_SEQ, recipe.name, "cuda", None, layerwise)
            plan = planned(layout, Asked(kind, dense, "bf16", world), shape)
            try:
                plan, _ = fit_plan(layout, plan, AUTO, shape, recipe=recipe, gpu_mem_gib=hw.memory_bytes / GiB)
            except MemoryPlanError:
                continue
            config = f"{plan.experts_residency} experts" + (", dense fsdp2" if dense == "fsdp2" else "")
            return f"{config}, batch {batch}", predict_run(layout, plan, shape, recipe=recipe,
                                                            calib_size=CALIB_SIZE, hardware=hw)
    return None


def _cell(t: WallTime, phase: str) -> str:
    p = t.phases[phase]
    return f"{_duration(p.seconds)} ({p.bottleneck})"


def reference_table(layouts: dict[str, tuple[CheckpointLayout, str]]) -> str:
    """The markdown table for ``layouts``: model name -> (its layout, the recipe ``--qformat nvfp4`` means for
    it)."""
    lines = [HEADER, "|---|---|---|---|---|---|---|---|---|---|"]
    for model, (layout, recipe_name) in layouts.items():
        for hw_name in HARDWARE:
            hw = PRESETS[hw_name]
            reference = _run(layout, recipe_name, 1, True, hw)
            gpu = hw_name.removesuffix("-node").upper()
            for world in WORLDS:
                for layerwise in (True, False):
                    mode = "layerwise" if layerwise else "resident"
                    found = _run(layout, recipe_name, world, layerwise, hw)
                    if found is None:
                        lines.append(f"| {model} | {world} x {gpu} | {mode} | does not fit ||||||")
                        continue
                    residency, t = found
                    speedup = f"{reference[1].total / t.total:.1f}x" if reference else "-"
                    lines.append(f"| {model} | {world} x {gpu} | {mode} | {residency} | {_cell(t, 'load')} | "
                                 f"{_cell(t, 'calibration')} | {_cell(t, 'export')} | {_duration(t.total)} | "
                                 f"{t.bottleneck} | {speedup} |")
    return "\n".join(lines)


def nvfp4_recipe(layout: CheckpointLayout) -> str:
    """The recipe ``--qformat nvfp4`` means for the layout's model (its spec's own, else the preset)."""
    return layout.spec.recipes.qformat.get("nvfp4", "presets/nvfp4")
