"""The steps that decide a run, each written once: hf_ptq's preflight checks call them in its order
(``run/preflight.py``, interleaved with its refusals), and a library call composes them into the same
``RunPlan`` (``plan_library_load``: ``load_pretrained``). So a convenience function decides nothing of its
own: same inputs, same spec, reader, decision table, dtype, distribution plan, residency and decode chunk.

In the **plan** layer (above ``memory``, below ``load``): ``load`` calls it, and the preflight, a layer
above ``check``, calls it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..checkpoint import CheckpointReader, read_config
from ..checkpoint.source_check import SourceLayout, check_config, check_experts
from ..recipe import Recipe, load_recipe
from ..spec import ModelSpec, get_spec
from ..spec.config import load_dtype
from .plan import DTYPE_CHOICES, PtqConfig, RunPlan

if TYPE_CHECKING:
    from ..dist.plan import DistributionPlan
    from ..memory.inventory import CheckpointLayout
    from ..memory.planner import Estimate
    from ..quant.decisions import DecisionTable

__all__ = ["CheckedSource", "check_library_source", "library_config", "plan_distribution", "plan_library_load", "plan_memory", "read_source", "run_dtype",
           "run_recipe", "run_spec"]


def run_spec(checkpoint: Path) -> tuple[dict, ModelSpec]:
    """config.json and the spec its ``model_type`` names."""
    raw = read_config(checkpoint)
    return raw, get_spec(raw.get("model_type", ""))


def run_recipe(config: PtqConfig, spec: ModelSpec) -> Recipe:
    """The recipe ``config`` names for this spec, with the flags' overrides."""
    return load_recipe(config.recipe_name(spec), overrides=config.recipe_overrides())


def read_source(checkpoint: Path, raw: dict, spec: ModelSpec) -> tuple[CheckpointReader, SourceLayout]:
    """The run's one reader of the source (the spec's checkpoint view) and the routed experts as stored, checked
    against config.json (``source_check``, headers only)."""
    reader = CheckpointReader(checkpoint, view=spec.loading.checkpoint_view)
    check_config(raw, spec)
    return reader, check_experts(reader.headers(), raw, spec, reader.stored_name)


def run_dtype(config: PtqConfig, raw: dict) -> torch.dtype:
    """The load dtype: ``--dtype``, else transformers' rule on config.json (``load_dtype``; decision 0001)."""
    return getattr(torch, config.dtype) if config.dtype else load_dtype(raw)


def plan_distribution(config: PtqConfig, spec: ModelSpec, raw: dict, *, rank: int, world_size: int,
                      device: torch.device | None, dtype: torch.dtype,
                      experts_implementation: str | None = None) -> DistributionPlan:
    """This rank's ``DistributionPlan`` (``decide_plan``: refuses what cannot work), its residency still open.
    ``experts_implementation``: a library caller's choice (hf_ptq takes the plan's default)."""
    from ..dist.plan import decide_plan

    text = raw.get("text_config", raw)
    return decide_plan(config.plan, spec=spec, num_experts=int(text[spec.experts.num_experts_attr]), rank=rank,
                       world_size=world_size, device=device or torch.device("cpu"), ep_degree=config.ep_degree,
                       experts_implementation=experts_implementation, dense=config.dense, dtype=dtype)


def plan_memory(config: PtqConfig, *, reader: CheckpointReader, raw: dict, spec: ModelSpec, source: SourceLayout,
                recipe: Recipe, table: DecisionTable, distribution: DistributionPlan, dtype: torch.dtype,
                layerwise: bool, decode_chunk: int | None = None,
                ) -> tuple[CheckpointLayout, DistributionPlan, Estimate]:
    """The planner's verdict on ``distribution`` at the run's calibration shape (``fit_plan``): the layout read
    off the run's reader, the plan with its experts residency (``config.experts``; ``auto`` resolved) and decode
    chunk, the estimate; ``MemoryPlanError`` when it cannot fit the budget (``--gpu_mem_gib``, else the
    accelerator's memory, else host RAM per local rank)."""
    from ..memory.inventory import layout_of
    from ..memory.planner import RunShape, fit_plan

    layout = layout_of(reader, raw, spec, source)
    shape = RunShape(config.batch_size, config.calib_seq, recipe.name, "cuda" if torch.cuda.is_available() else "cpu",
                     dtype, layerwise=layerwise)
    plan, est = fit_plan(layout, distribution, config.experts, shape, recipe=recipe, gpu_mem_gib=config.gpu_mem_gib,
                         table=table, decode_chunk=decode_chunk)
    return layout, plan, est


def library_config(path: str | Path, *, plan: str, trust_remote_code: bool, dtype: torch.dtype | None,
                   ep_degree: int | None, dense: str, experts: str,
                   allow_nonfinite_passthrough: bool) -> PtqConfig:
    """The ``PtqConfig`` a ``load_pretrained`` call asks for: its arguments, the default recipe (``--qformat
    nvfp4``'s, the model's own where its spec names one) and the memory planner's default calibration shape
    (``RunShape``: a library load does not know the calibration it will run)."""
    from ..dist.plan import check_request_names
    from ..memory.planner import RunShape

    check_request_names(plan, dense, experts)  # decide_plan's wording, before PtqConfig's own
    name = None if dtype is None else str(dtype).removeprefix("torch.")
    if name not in DTYPE_CHOICES:
        raise ValueError(f"dtype={dtype}; choose one of torch.bfloat16, torch.float32 (or None: the config's)")
    return PtqConfig(pyt_ckpt_path=Path(path), trust_remote_code=trust_remote_code, plan=plan, dtype=name,
                     ep_degree=ep_degree, dense=dense, experts=experts, batch_size=RunShape.batch_size,
                     calib_seq=RunShape.calib_seq, allow_nonfinite_passthrough=allow_nonfinite_passthrough)


@dataclass(frozen=True)
class CheckedSource:
    """What a library load's source check decided (``check_library_source``): config.json, spec, recipe, the one
    reader, the experts as stored, the decision table."""

    raw: dict
    spec: ModelSpec
    recipe: Recipe
    reader: CheckpointReader
    source: SourceLayout
    table: DecisionTable


def check_library_source(config: PtqConfig) -> CheckedSource:
    """The preflight's first steps on ``config``'s checkpoint: spec, recipe, reader and source check, decision
    table (``run_table``). A load runs it as one agreed step over the ranks (a rank's bad shard fails all)."""
    from ..quant.decisions import run_table

    checkpoint = config.pyt_ckpt_path
    raw, spec = run_spec(checkpoint)
    recipe = run_recipe(config, spec)
    reader, source = read_source(checkpoint, raw, spec)
    return CheckedSource(raw, spec, recipe, reader, source, run_table(reader.inventory(), spec, recipe, source.carried))


def plan_library_load(config: PtqConfig, *, rank: int, world_size: int, device: torch.device | None,
                      experts_implementation: str | None = None, decode_chunk: int | None = None,
                      checked: CheckedSource | None = None) -> RunPlan:
    """The ``RunPlan`` of a library load (``load_pretrained``): the preflight's deciding steps, in its order, on
    ``config`` -- ``checked`` (default: ``check_library_source`` here), dtype, distribution plan, memory fit --
    without the checks about an export, calibration data or a tokenizer (a load has none). The plan's refusals
    are decided alike on every rank from the same inputs, and raised as themselves (``PlanError``,
    ``MemoryPlanError``). No export path and no export format (``export_checkpoint``, the library's export entry
    point, resolves its ``format`` name); ``texts`` empty."""
    c = checked or check_library_source(config)
    dtype = run_dtype(config, c.raw)
    distribution = plan_distribution(config, c.spec, c.raw, rank=rank, world_size=world_size, device=device,
                                     dtype=dtype, experts_implementation=experts_implementation)
    layout, distribution, memory = plan_memory(config, reader=c.reader, raw=c.raw, spec=c.spec, source=c.source,
                                               recipe=c.recipe, table=c.table, distribution=distribution,
                                               dtype=dtype, layerwise=False, decode_chunk=decode_chunk)
    return RunPlan(config, config.pyt_ckpt_path, config.trust_remote_code, None, None,
                   c.raw, c.spec, c.reader, c.source, layout, c.recipe, c.table, distribution, memory, [], dtype=dtype)
