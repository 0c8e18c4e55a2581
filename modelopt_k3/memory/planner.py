"""Memory planner: what one rank holds at each stage of a PTQ run, before any weight is read.

``plan_memory(path, world_size=N, ...)`` reads ``config.json`` and the safetensors headers
(``inventory.py``), and for each plan (``whole``, ``expert_parallel`` with the dense part replicated or
FSDP2-sharded, ``fsdp2``) and experts residency (``bf16``, ``packed``) estimates per rank:

* **resident**: parameters this rank holds (dense part, replicated or its FSDP2 rows; its experts,
  decoded or as MXFP4 bytes);
* **workspace**: the packed experts' decode buffer (one layer's local experts, or a chunk);
* **FSDP gathered**: the FSDP2 root (gathered for the whole forward) plus the largest unit being run
  (twice on an accelerator, where the next unit's all-gather overlaps);
* **MoE**: the all-to-all buffers for ``batch_size x calib_seq`` tokens at top-k and the owner's
  experts implementation (``dist/a2a.py``, transformers' experts interface), peak over its steps;
* **activations**: the rest of one calibration forward (the model spec's ``activation_memory``);
* **export**: the writer's in-memory shard (up to its spill limit, plus one tensor), the lossless
  cast of 16 experts and the largest dense quantization;
* **weight algorithm**: what the recipe's algorithm holds (``_algorithm_state``): input sums through its
  forwards (local_hessian's block sums, GPTQ's full ``[in, in]`` ones), and until the export GPTQ's updated
  weight copies and the searched block scales;
* **runtime**: the framework itself (host: measured; accelerator: CUDA context, NCCL, allocator slack).

Peak = the largest of the stages load, quantize setup (weight amax), calibration and export, each
resident + runtime + what that stage adds (calibration and export include the weight algorithm's state). It is a model of this code's allocations, not a trace:
routing is assumed balanced across owners (the all-to-all receive is larger under skew), and
eager MLA attention (what the vendored remote code falls back to) is counted.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from ..dist.placement import PlanError
from ..dist.plan import (
    AUTO,
    DenseMode,
    DistributionPlan,
    PlanKind,
    Residency,
    allowed_residencies,
    decide_plan,
    default_local_implementation,
)
from ..export.writer import DEFAULT_SPILL_BYTES
from ..quant.decisions import DecisionTable
from ..recipe import QuantFormat, Recipe, load_recipe
from ..spec.names import enclosing
from .activations import ActivationModel
from .inventory import CheckpointLayout, ExpertGroup, TensorMeta, dense_format, experts_formats, read_layout

GiB = 2**30
# RSS of a rank's process besides weights and activations through calibration and export: torch 2.13
# (CPU), transformers 5.24, the remote code, tokenizer and data, allocator arenas (measured on the CI
# machine: ~0.42 GiB after load, ~0.5 GiB after calibration; benchmarks/bench_memory.py checks the planner).
HOST_RUNTIME_BYTES = int(0.5 * GiB)
# CUDA context, NCCL buffers and caching-allocator slack per GPU (not measured here: no GPU in CI).
DEVICE_RUNTIME_BYTES = int(1.5 * GiB)
EXPERTS_PER_READ = 16  # load/pretrained.py: experts converted at a time
EXPERTS_PER_CAST = 16  # export/model_export.py: experts cast at a time
F32 = 4
PLANS: tuple[tuple[PlanKind, DenseMode], ...] = (
    (PlanKind.WHOLE, DenseMode.REPLICATED),
    (PlanKind.EXPERT_PARALLEL, DenseMode.REPLICATED),
    (PlanKind.EXPERT_PARALLEL, DenseMode.FSDP2),
    (PlanKind.FSDP2, DenseMode.REPLICATED),
)
RESIDENCIES: tuple[Residency, ...] = tuple(Residency)


class MemoryPlanError(ValueError):
    """A configuration that cannot fit; the message has the numbers and a configuration that would."""


@dataclass(frozen=True)
class RunShape:
    """The run being planned: calibration batch per rank, tokens per sequence, the recipe."""

    batch_size: int = 4
    calib_seq: int = 2048
    recipe: str = "presets/nvfp4"
    device: str = "cuda"  # "cuda": accelerator memory; "cpu": host RAM holds everything
    dtype: torch.dtype | None = None  # load dtype (default: the config's)
    layerwise: bool = False  # one decoder layer resident at a time (``--layerwise``)


class Asked(NamedTuple):
    """One row of the planner's table: a plan request as the CLI spells it (``decide_plan`` turns it into
    the run's ``DistributionPlan``, or refuses it)."""

    kind: str  # auto | whole | expert_parallel | fsdp2
    dense: str
    residency: str
    world_size: int
    ep_degree: int | None = None  # None: the world size (decide_plan's default)


# The compute capability of the accelerator the planner plans for when it is not this machine's (H100/H200).
PLANNED_CAPABILITY = (9, 0)


def planned_local_implementation(layout: CheckpointLayout, shape: RunShape) -> str | None:
    """What would run a rank's own experts on ``shape.device`` at the run's load dtype (the run's rule,
    ``default_local_implementation``, for a ``PLANNED_CAPABILITY`` device); None on the host (decide_plan's
    own default, eager, which queries nothing)."""
    if shape.device == "cpu":
        return None
    dtype = shape.dtype or layout.config_dtype
    return default_local_implementation(torch.device(shape.device), dtype, capability=PLANNED_CAPABILITY)


def plan_label(kind: str, dense: str, ep_degree: int, world_size: int) -> str:
    if kind == PlanKind.EXPERT_PARALLEL:
        return f"expert_parallel, dense {dense}" + (f", EP {ep_degree}" if ep_degree != world_size else "")
    return str(kind)


def planned(layout: CheckpointLayout, asked: Asked, shape: RunShape | None = None) -> DistributionPlan:
    """The ``DistributionPlan`` the run would use for ``asked`` (rank 0: FSDP2 rank 0 holds the most rows),
    made by the run's own ``decide_plan`` (placement, EP degree and its environment default, refusals) and
    ``with_residency``; raises ``PlanError`` for what the run would refuse."""
    shape = shape or RunShape()
    device = torch.device(shape.device)
    # The owner's implementation on the device planned for, by the run's own rule (decide_plan would query a
    # CUDA device that may not be this machine's: the planner plans GPU runs from anywhere).
    impl = planned_local_implementation(layout, shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # settings a plan ignores are the run's to warn about
        plan = decide_plan(asked.kind, spec=layout.spec, num_experts=layout.num_experts, rank=0,
                           world_size=asked.world_size, device=device, ep_degree=asked.ep_degree,
                           experts_implementation=impl, dense=asked.dense, dtype=shape.dtype)
    return plan.with_residency(asked.residency, packed_source=layout.packed_source)


@dataclass
class Estimate:
    """Bytes per rank for one configuration (the largest rank: FSDP2 rank 0 holds the most rows)."""

    asked: Asked
    plan: DistributionPlan | None  # None when the run would refuse ``asked`` (``refused`` says why)
    refused: str | None = None
    resident: int = 0
    resident_dense: int = 0
    resident_experts: int = 0
    largest_module: tuple[str, int] = ("", 0)  # the largest resident module
    workspace: int = 0
    decode_chunk: int | None = None  # experts decoded at a time (None: a whole layer / not packed)
    fsdp_gathered: int = 0
    fsdp_unit: str = ""
    moe: int = 0
    moe_detail: str = ""
    activations: int = 0
    activation_phase: str = ""
    load_transient: int = 0
    amax_transient: int = 0
    export: int = 0
    algorithm_sums: int = 0  # the weight algorithm's input sums, held through its forwards
    algorithm_weights: int = 0  # what it keeps per weight until the export (GPTQ's updated copies, block scales)
    runtime: int = 0
    stages: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return max(self.stages.values()) if self.stages else 0

    @property
    def peak_stage(self) -> str:
        return max(self.stages, key=self.stages.get) if self.stages else ""

    @property
    def largest_transient(self) -> tuple[str, int]:
        terms = {
            "decode workspace": self.workspace,
            f"FSDP2 gathered ({self.fsdp_unit})" if self.fsdp_unit else "FSDP2 gathered": self.fsdp_gathered,
            f"MoE all-to-all + experts ({self.moe_detail})": self.moe,
            f"activations ({self.activation_phase})": self.activations,
            "export buffers": self.export,
            "weight algorithm (input sums + updated weights)": self.algorithm_sums + self.algorithm_weights,
        }
        return max(terms.items(), key=lambda kv: kv[1])

    @property
    def residency(self) -> str:
        return self.plan.experts_residency if self.plan else self.asked.residency

    def label(self) -> str:
        if self.plan is None:
            return plan_label(self.asked.kind, self.asked.dense, self.asked.ep_degree or self.asked.world_size,
                              self.asked.world_size)
        return plan_label(self.plan.kind, self.plan.dense, self.plan.ep_degree, self.plan.world_size)

    def fits(self, budget: int | None) -> bool | None:
        if self.refused:
            return False
        return None if budget is None else self.peak <= budget


# ------------------------------------------------------------------------------ the estimate


def _local_rows(n: int, world: int) -> int:
    """FSDP2 rank 0's rows of a dim of ``n`` (torch.chunk: ceil(n / world))."""
    return -(-n // world)


def _dense_bytes(t: TensorMeta, size: int, world: int) -> int:
    """Bytes of the rows FSDP2 rank 0 holds of ``t`` (all of it when ``world`` is 1), ``size`` bytes each."""
    if world == 1 or not t.shape:
        return t.numel * size
    return _local_rows(t.shape[0], world) * (t.numel // t.shape[0]) * size


@dataclass
class _Prepared:
    """What every estimate of one layout, decision table and dtype shares (computed once)."""

    sizes: list[tuple[TensorMeta, int]]  # dense tensors with their loaded element size
    quantized: list[TensorMeta]  # dense Linear weights the decision table quantizes
    formats: dict[str, QuantFormat]  # their formats, by module
    experts_formats: dict[str, dict[str, QuantFormat | None]]  # experts module -> fused param -> format
    calibrates: bool  # the recipe takes some input scale from data
    unit_bytes: dict[str, int]  # FSDP2 unit prefix ("" = root) -> full bytes once loaded


def _prepare(layout: CheckpointLayout, table: DecisionTable, dtype: torch.dtype) -> _Prepared:
    """The sizes, and what the run's decision table (made once: the preflight's, else the layout's own) does
    to each weight: no recipe is matched to modules here."""
    key = ("prepared", id(table), dtype)
    if key not in layout.cache:
        sizes = [(t, layout.load_dtype(t, dtype).itemsize) for t in layout.dense]
        size_of = {t.name: n for t, n in sizes}
        formats = {t.module: dense_format(table, t.module) for t in layout.dense
                   if t.name.endswith(".weight") and len(t.shape) == 2}
        quantized = [t for t in layout.dense if formats.get(t.module) is not None and t.name.endswith(".weight")]
        experts = {g.module: experts_formats(table, g, layout.spec) for g in layout.experts}
        calibrates = table.recipe.kv_cache is not None or any(
            d.format.needs_calibration for d in table.quantized().values())
        units = {u: sum(t.numel * size_of[t.name] for t in ts) for u, ts in layout.fsdp_units().items()}
        layout.cache[key] = (table, _Prepared(sizes, quantized, {t.module: formats[t.module] for t in quantized},
                                              experts, calibrates, units))
    return layout.cache[key][1]


def _local_experts(group: ExpertGroup, plan: DistributionPlan) -> int:
    if plan.expert_parallel:
        return plan.expert_placement.per_rank  # the run's own placement
    if plan.kind is PlanKind.FSDP2:
        return _local_rows(group.num_experts, plan.world_size)
    return group.num_experts


def _expert_bytes(group: ExpertGroup, residency: Residency, b: int) -> int:
    """Resident bytes of one expert: its source bytes (packed) or decoded weights."""
    return group.stored_bytes_per_expert if residency is Residency.PACKED else group.decoded_numel_per_expert * b


def _refusal(layout: CheckpointLayout, asked: Asked, shape: RunShape) -> tuple[DistributionPlan | None, str | None]:
    """(the run's plan, None), or (None, why the run would refuse it): the run's own checks, not a copy."""
    try:
        return planned(layout, asked, shape), None
    except PlanError as err:
        return None, str(err)


def owner_bytes(impl: str, r: int, act: ActivationModel, group: ExpertGroup, b: int, local_experts: int) -> int:
    """Peak bytes of the owner's experts implementation ``impl`` on ``r`` routed rows (its allocations, not its
    inputs or weights); ``tests/memory/test_planner.py`` measures the eager one's live tensors against it."""
    dl = act.latent_dim
    if impl == "batched_mm":  # one weight matrix per (token, expert) pair
        return r * group.decoded_numel_per_expert * b + r * act.expert_row_bytes
    if impl == "grouped_mm":  # every row at once: inputs, gate/up + activation, down, fp32 weighting
        return r * dl * (2 * b + 2 * F32) + r * act.expert_row_bytes
    # eager: gathered inputs, outputs, fp32 combine of the bare outputs; one expert's rows at a time
    return r * dl * (3 * b + 2 * F32) + -(-r // max(local_experts, 1)) * act.expert_row_bytes


def _moe_phase(act: ActivationModel, plan: DistributionPlan, impl: str, local_experts: int, group: ExpertGroup,
               b: int, chunk: int | None, all_experts_rows: int) -> tuple[int, str]:
    """Peak bytes while a MoE layer's routed experts run: all-to-all steps and the owner's implementation."""
    dl, rows = act.latent_dim, act.tokens * act.top_k  # rows sent, and (balanced) received, per rank

    def owner(r: int) -> int:
        return owner_bytes(impl, r, act, group, b, local_experts)

    def decoded_owner(r: int) -> int:
        if chunk is None or chunk >= local_experts:
            return owner(r)
        # chunks: the slot buffer and this chunk's inputs, then the implementation on the chunk's rows
        r_chunk = -(-r * chunk // local_experts)
        return r * dl * b + r_chunk * dl * b + owner(r_chunk)

    combine = rows * dl * 2 * F32 + act.tokens * dl * (F32 + b)
    if plan.expert_parallel:
        ids = 8 * rows
        steps = [
            2 * (rows * dl * b + ids),  # send_x and recv_x
            rows * dl * b + ids + decoded_owner(rows) + rows * dl * b,  # recv_x, the owner, its output
            2 * rows * dl * b,  # the output and what comes back
            2 * rows * dl * b + combine,  # per-slot outputs and the fp32 combine
        ]
        detail = f"{impl} on {rows} rows"
    else:  # the experts module gathers, computes and combines (fp32) itself: the owner's own terms
        steps = [decoded_owner(rows)]
        detail = f"{impl} on {rows} rows"
    peak = max(steps)
    if all_experts_rows:  # calibrate_all_experts: every rank's tokens through every local expert, eager
        peak = max(peak, all_experts_rows * dl * b + decoded_owner(all_experts_rows * local_experts))
        detail += f"; calibrate_all_experts {all_experts_rows} x {local_experts} rows"
    return act.moe_block + peak, detail


def estimate_asked(layout: CheckpointLayout, asked: Asked, shape: RunShape = RunShape(), **kw) -> Estimate:
    """``estimate`` of the plan the run would make of ``asked``, or its refusal."""
    plan, why = _refusal(layout, asked, shape)
    if plan is None:
        return Estimate(asked, None, refused=why)
    why = plan.layerwise_refusal() if shape.layerwise else None
    if why is not None:
        return Estimate(asked, None, refused=why)
    return estimate(layout, plan, shape, **kw)


def _recipe_and_table(layout: CheckpointLayout, shape: RunShape, recipe: Recipe | None,
                      table: DecisionTable | None) -> tuple[Recipe, DecisionTable]:
    """The run's recipe and decision table: the table given (a run's, decided once by its preflight), else the
    recipe's (``shape.recipe`` by default) decided on the layout's headers, as the preflight would."""
    if table is not None:
        if recipe is not None and table.recipe is not recipe:
            raise ValueError(f"the decision table is for recipe {table.recipe.name}, not {recipe.name}")
        return table.recipe, table
    recipe = recipe or load_recipe(shape.recipe)
    return recipe, layout.decision_table(recipe)


def estimate(
    layout: CheckpointLayout,
    plan: DistributionPlan,
    shape: RunShape = RunShape(),
    *,
    recipe: Recipe | None = None,
    budget: int | None = None,
    decode_chunk: int | None = None,
    table: DecisionTable | None = None,
) -> Estimate:
    """Per-rank bytes of the run's ``plan`` (see the module docstring; ``planned`` makes one). With ``budget``
    (bytes per rank), packed experts decode the largest chunk of experts that fits (a whole layer when it
    does). The owner's experts run the plan's implementation (``local_experts_implementation``); what is
    quantized, and how, is the run's decision ``table`` (default: ``recipe`` decided on the layout's headers)."""
    asked = Asked(plan.kind, plan.dense, plan.experts_residency, plan.world_size, plan.ep_degree)
    est = Estimate(asked, plan)
    recipe, table = _recipe_and_table(layout, shape, recipe, table)
    dtype = shape.dtype or layout.config_dtype
    accel = shape.device != "cpu"
    run = _Run(layout, plan, recipe, _prepare(layout, table, dtype), dtype.itemsize, accel,
               plan.local_experts_implementation)
    est.runtime = DEVICE_RUNTIME_BYTES if accel else HOST_RUNTIME_BYTES
    _resident(est, run)
    if shape.layerwise:
        _layerwise_resident(est, run, shape)
    if plan.fsdp_sharded:
        _fsdp_gathered(est, run)
    act = layout.spec.memory.activation_memory(layout.text_config, shape.batch_size, shape.calib_seq, run.b) if (
        run.prep.calibrates and layout.spec.memory.activation_memory) else None  # calibration only when data sets a scale
    if act:
        est.activation_phase, phase = act.largest_phase
        est.activations = act.carried + phase
    est.export = _export_bytes(run)
    est.load_transient = _load_transient(run)
    est.amax_transient = _amax_transient(run)
    base = est.resident + est.runtime
    est.stages = {"load": base + est.load_transient, "quantize setup": base + est.amax_transient}
    _calibration(est, run, act, base, budget, decode_chunk)
    est.algorithm_sums, est.algorithm_weights = _algorithm_state(run, shape.layerwise)
    if "calibration" in est.stages:
        est.stages["calibration"] += est.algorithm_sums + est.algorithm_weights
    est.stages["export"] = base + est.algorithm_weights + est.export  # export releases the decode workspace first
    return est


@dataclass
class _Run:
    """What every part of one estimate reads: the layout, configuration, recipe and its preparation, the
    weight itemsize, whether it runs on an accelerator, the owner's experts implementation, and the
    experts per rank (``local_e``) with the layer whose local experts decode largest (``biggest``)."""

    layout: CheckpointLayout
    plan: DistributionPlan
    recipe: Recipe
    prep: _Prepared
    b: int
    accel: bool
    impl: str
    local_e: dict[str, int] = field(init=False)
    biggest: ExpertGroup | None = field(init=False)

    def __post_init__(self) -> None:
        self.local_e = {g.module: _local_experts(g, self.plan) for g in self.layout.experts}
        self.biggest = max(self.layout.experts, key=lambda g: self.local_e[g.module] * g.decoded_numel_per_expert,
                           default=None)

    @property
    def e_local(self) -> int:
        return self.local_e[self.biggest.module] if self.biggest else 0

    @property
    def dense_world(self) -> int:
        return self.plan.world_size if self.plan.fsdp_sharded else 1


def _resident(est: Estimate, run: _Run) -> None:
    """Resident parameters, by module, and the largest of them."""
    by_module: dict[str, int] = {}
    for t, size in run.prep.sizes:
        by_module[t.module] = by_module.get(t.module, 0) + _dense_bytes(t, size, run.dense_world)
    est.resident_dense = sum(by_module.values())
    for g in run.layout.experts:
        by_module[g.module] = run.local_e[g.module] * _expert_bytes(g, run.plan.experts_residency, run.b)
    est.resident_experts = sum(run.local_e[g.module] * _expert_bytes(g, run.plan.experts_residency, run.b)
                               for g in run.layout.experts)
    est.resident = est.resident_dense + est.resident_experts
    est.largest_module = max(by_module.items(), key=lambda kv: kv[1]) if by_module else ("", 0)


def _layer_of(name: str, regex: str) -> str | None:
    """The decoder layer (its module name) that ``name`` lies in, None outside every layer."""
    return enclosing(name, lambda prefix: re.search(regex, prefix) is not None)


def _layerwise_resident(est: Estimate, run: _Run, shape: RunShape) -> None:
    """``--layerwise``: what lies outside the decoder layers stays, plus the largest layer (its dense part and
    this rank's experts); on the host (``cpu``) also two layers' captured inputs of one batch (the replayed
    layer's and the next one's; an accelerator run keeps them in host memory)."""
    regex = run.layout.spec.report.decoder_layer_regex
    if regex is None:
        raise MemoryPlanError(f"model_type {run.layout.spec.model_type} names no decoder layers: no layerwise plan")
    dense: dict[str | None, int] = {}
    experts: dict[str | None, int] = {}
    for t, size in run.prep.sizes:
        layer = _layer_of(t.module, regex)
        dense[layer] = dense.get(layer, 0) + _dense_bytes(t, size, 1)
    for g in run.layout.experts:
        layer = _layer_of(g.module, regex)
        experts[layer] = experts.get(layer, 0) + run.local_e[g.module] * _expert_bytes(g, run.plan.experts_residency,
                                                                                        run.b)
    # In checkpoint order, so that of equally large layers the first is named (a set's order follows the string
    # hash, which PYTHONHASHSEED changes from one process to the next).
    layers = [n for n in dict.fromkeys([*dense, *experts]) if n is not None]
    biggest = max(layers, key=lambda n: dense.get(n, 0) + experts.get(n, 0), default=None)
    est.resident_dense = dense.get(None, 0) + dense.get(biggest, 0)
    est.resident_experts = experts.get(None, 0) + experts.get(biggest, 0)
    hidden = int(run.layout.text_config.get("hidden_size", 0))
    cache = 0 if run.accel else 2 * shape.batch_size * shape.calib_seq * hidden * run.b
    est.resident = est.resident_dense + est.resident_experts + cache
    if biggest is not None:
        est.largest_module = (f"{biggest} (the largest layer)", dense.get(biggest, 0) + experts.get(biggest, 0))


def _fsdp_gathered(est: Estimate, run: _Run) -> None:
    """FSDP2: the root stays gathered through the forward; the largest unit while it runs (an
    accelerator's next all-gather overlaps the current unit); the fsdp2 plan gathers experts too."""
    full = dict(run.prep.unit_bytes)
    root = full.pop("", 0)
    unit, unit_bytes = max(full.items(), key=lambda kv: kv[1], default=("", 0))
    biggest = run.biggest
    experts_full = biggest.num_experts * biggest.decoded_numel_per_expert * run.b if (
        biggest and run.plan.kind is PlanKind.FSDP2) else 0
    est.fsdp_gathered = root + unit_bytes * (2 if run.accel else 1) + experts_full
    est.fsdp_unit = f"root + {unit}" + (" + its experts" if experts_full else "")


def _export_bytes(run: _Run) -> int:
    """The writer's buffer (spill limit + one tensor), then the larger of a 16-expert cast (source bytes
    read or resident, NVFP4 out) and the largest dense quantization (gathered when sharded)."""
    layout, biggest = run.layout, run.biggest
    largest_q = max((t.numel for t in run.prep.quantized), default=0)
    largest_tensor = max([t.nbytes for t in (*layout.dense, *layout.carried_tensors)]
                         + [g.stored_bytes_per_expert for g in layout.experts] + [0])
    cast = min(EXPERTS_PER_CAST, run.e_local) * biggest.stored_bytes_per_expert * 3 if biggest else 0
    dense_q = largest_q * (run.b * (run.dense_world > 1) + (3 * F32 if run.accel else 1) + 1)
    # This rank's output: its experts (NVFP4 is 4.5 bits a weight against MXFP4's 4.25) and its share of the rest.
    output = sum(run.local_e[g.module] * g.stored_bytes_per_expert for g in layout.experts) * 18 // 17
    output += sum(t.nbytes for t in (*layout.dense, *layout.carried_tensors)) // run.plan.world_size
    return min(DEFAULT_SPILL_BYTES, output) + largest_tensor + max(cast, dense_q)


def _load_transient(run: _Run) -> int:
    """16 experts converted at a time (bf16: decoded twice, stacked and concatenated), or the largest
    dense tensor read and cast."""
    transient = 0
    if run.biggest:
        per_read = min(EXPERTS_PER_READ, run.e_local)
        packed = run.plan.experts_residency is Residency.PACKED
        conv = run.biggest.stored_bytes_per_expert * (3 if packed else 1)
        conv += 0 if packed else 2 * run.biggest.decoded_numel_per_expert * run.b
        transient = per_read * conv
    return max(transient, max((t.nbytes for t in run.layout.dense), default=0))


def _amax_transient(run: _Run) -> int:
    """Quantize setup: weight amax in fp32, 16 experts at a time; a dense weight (its local rows) at once."""
    largest_dense_rows = max((_dense_bytes(t, F32, run.dense_world) for t in run.prep.quantized), default=0)
    transient = 2 * largest_dense_rows
    if run.biggest:
        out_in = max(o * i for o, i in run.biggest.fused_shapes(run.layout.spec).values())
        per_expert = (2 * out_in * F32 if run.plan.experts_residency is Residency.BF16
                      else out_in // 2 + out_in // 32 * 2 * F32)
        transient = max(transient, min(EXPERTS_PER_CAST, run.e_local) * per_expert)
    return transient


def _calibration(est: Estimate, run: _Run, act, base: int, budget: int | None, decode_chunk: int | None) -> None:
    """The calibration forward's peak (and the decode workspace); with a budget, packed experts decode the
    largest chunk that fits."""
    plan, biggest, e_local = run.plan, run.biggest, run.e_local
    packed = plan.experts_residency is Residency.PACKED
    all_rows = act.tokens * plan.ep_degree if (act and run.recipe.calibrate_all_experts and biggest) else 0

    def calibration(chunk: int | None) -> tuple[int, int, int, str]:
        ws = 0
        if packed and biggest:
            ws = min(chunk or e_local, e_local) * biggest.decoded_numel_per_expert * run.b
        if not act:
            return ws, base + ws, 0, ""
        moe, detail = _moe_phase(act, plan, run.impl, e_local, biggest, run.b, chunk, all_rows) if biggest else (0, "")
        moe_total = act.carried + ws + moe
        forward = base + est.fsdp_gathered + max(est.activations, moe_total)
        return ws, forward, moe, detail

    chunk = decode_chunk
    ws, forward, moe, detail = calibration(chunk)
    if budget is not None and packed and biggest and chunk is None and forward > budget:
        for c in range(e_local - 1, 0, -1):  # the largest chunk that fits (few candidates: experts per rank)
            if calibration(c)[1] <= budget:
                chunk = c
                break
        ws, forward, moe, detail = calibration(chunk)
    est.workspace, est.moe, est.moe_detail = ws, moe, detail
    est.decode_chunk = chunk if (chunk is not None and chunk < e_local) else None
    if act:
        est.stages["calibration"] = forward


def _algorithm_state(run: _Run, layerwise: bool) -> tuple[int, int]:
    """(input sums, per-weight state) the recipe's weight algorithm holds (``quant/calibrators``), over every
    NVFP4 weight it visits: dense NVFP4 Linears and this rank's routed experts that are not the lossless
    MXFP4 cast (``ExpertGroup.packed``). A layerwise run holds one decoder layer's (the largest).

    Per weight (per local expert for experts) the algorithm's config says it (``AlgorithmConfig.state_bytes``:
    e.g. local_hessian's float64 block sums, GPTQ's ``[in, in]`` sums and updated weight, the searched block scales).
    """
    from ..quant.calibrators import algorithm_config
    from ..quant.schemes import NVFP4_TENSOR

    config = algorithm_config(run.recipe.algorithm)
    weights: list[tuple[str, int, int, int]] = []  # (module, copies, out, in)
    for t in run.prep.quantized:
        if run.prep.formats[t.module].weights is NVFP4_TENSOR:
            weights.append((t.module, 1, *t.shape))
    for g in run.layout.experts:
        if g.packed:
            continue
        formats = run.prep.experts_formats[g.module]
        weights += [(g.module, run.local_e[g.module], o, i) for param, (o, i) in g.fused_shapes(run.layout.spec).items()
                    if formats.get(param) is not None and formats[param].weights is NVFP4_TENSOR]
    by_layer: dict[str | None, list[int]] = {}
    regex = run.layout.spec.report.decoder_layer_regex
    for module, n, out, inp in weights:
        sums, kept = config.state_bytes(out, inp, run.b)
        layer = _layer_of(module, regex) if (layerwise and regex) else None
        totals = by_layer.setdefault(layer, [0, 0])
        totals[0] += n * sums
        totals[1] += n * kept
    if not by_layer:
        return 0, 0
    outside = by_layer.pop(None, [0, 0]) if layerwise else [0, 0]
    biggest = max(by_layer.values(), key=sum, default=[0, 0])
    return outside[0] + biggest[0], outside[1] + biggest[1]


# ------------------------------------------------------------------------------ the report


def device_budget(device: str, world_size: int, gpu_mem_gib: float | None) -> int | None:
    """Bytes one rank may use: ``gpu_mem_gib``, else the accelerator's memory, else host RAM shared by
    the ranks of one host (CPU)."""
    if gpu_mem_gib is not None:
        return int(gpu_mem_gib * GiB)
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    if device == "cpu":
        import psutil

        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        return psutil.virtual_memory().total // max(local, 1)
    return None


@dataclass
class MemoryReport:
    layout: CheckpointLayout
    shape: RunShape
    world_size: int
    budget: int | None
    estimates: list[Estimate]
    smallest: dict[tuple[str, str, str], int | None]  # (kind, dense, residency) -> smallest world that fits

    def rows(self) -> list[dict]:
        """One object per configuration (``modelopt-k3-plan --json``)."""
        out = []
        for e in self.estimates:
            fits = e.fits(self.budget)
            out.append({"plan": e.label(), "experts": str(e.asked.residency), "layerwise": self.shape.layerwise,
                        "world_size": e.asked.world_size, "peak_gib": None if e.refused else round(e.peak / GiB, 3),
                        "fits": fits, "refused": e.refused, "smallest_world": self.smallest.get(e.asked[:3]),
                        "weight_algorithm_gib": None if e.refused else
                        round((e.algorithm_sums + e.algorithm_weights) / GiB, 3)})
        return out

    def find(self, kind: str, dense: str, residency: str) -> Estimate:
        for e in self.estimates:
            if e.asked[:3] == (kind, dense, residency):
                return e
        raise KeyError((kind, dense, residency))

    def table(self) -> str:
        """A markdown table (GiB per rank; MiB when every figure is under 1 GiB)."""
        figures = [e.peak for e in self.estimates if not e.refused]
        unit, scale = ("GiB", GiB) if max(figures, default=0) >= GiB else ("MiB", 2**20)

        def fmt(n: int) -> str:
            v = n / scale
            return f"{v:.1f}" if v >= 10 else f"{v:.2f}"

        text = self.layout.text_config
        lines = [
            f"Memory plan for {self.layout.path.name}: {len(self.layout.experts)} MoE layers x "
            f"{self.layout.num_experts} experts, calibration {self.shape.batch_size} x {self.shape.calib_seq} tokens "
            f"per rank (top-{text.get('num_experts_per_token', text.get('num_experts_per_tok'))}), recipe {self.shape.recipe}, "
            + ("layerwise (one decoder layer resident), " if self.shape.layerwise else "") +
            f""
            f"{'accelerator' if self.shape.device != 'cpu' else 'host'} budget "
            + (f"{self.budget / GiB:.1f} GiB per rank" if self.budget else "unknown") + f"; figures in {unit} per rank",
            "",
            "| plan | experts | ranks | resident | workspace | FSDP gathered | MoE a2a+experts | activations | "
            "weight algorithm | export | peak (stage) | fits | smallest world that fits | largest resident module |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for e in self.estimates:
            c = e.asked
            smallest = self.smallest.get(c[:3])
            if e.refused:
                lines.append(f"| {e.label()} | {c.residency} | {c.world_size} | refused: {e.refused} ||||||||| "
                             f"{smallest or '-'} | |")
                continue
            fits = {True: "yes", False: "**no**", None: "?"}[e.fits(self.budget)]
            ws = fmt(e.workspace) + (f" ({e.decode_chunk} experts)" if e.decode_chunk else "")
            lines.append(
                f"| {e.label()} | {c.residency} | {c.world_size} | {fmt(e.resident)} | {ws} | {fmt(e.fsdp_gathered)} "
                f"| {fmt(e.moe)} | {fmt(e.activations)} | {fmt(e.algorithm_sums + e.algorithm_weights)} "
                f"| {fmt(e.export)} | {fmt(e.peak)} ({e.peak_stage}) "
                f"| {fits} | {smallest or '-'} | {e.largest_module[0]} ({fmt(e.largest_module[1])}) |"
            )
        return "\n".join(lines)


def _size(n: int) -> str:
    """``n`` bytes in the unit that reads best (GiB, MiB or KiB)."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale or unit == "KiB":
            v = n / scale
            return f"{v:.1f} {unit}" if v >= 10 else f"{v:.2f} {unit}"
    raise AssertionError


def _world_candidates(layout: CheckpointLayout, limit: int = 4096) -> list[int]:
    e = layout.num_experts
    return [w for w in range(2, limit + 1) if e % w == 0]


def smallest_world(layout: CheckpointLayout, kind: str, dense: str, residency: str, shape: RunShape,
                   recipe: Recipe, gpu_mem_gib: float | None) -> int | None:
    """The fewest ranks on which the configuration fits (None: no budget known, or none does)."""
    candidates = [1] if kind == PlanKind.WHOLE else _world_candidates(layout)
    for w in candidates:
        budget = device_budget(shape.device, w, gpu_mem_gib)
        if budget is None:
            return None
        est = estimate_asked(layout, Asked(kind, dense, residency, w), shape, recipe=recipe, budget=budget)
        if est.fits(budget):
            return w
    return None


def plan_memory(
    path: str | Path,
    *,
    world_size: int,
    gpu_mem_gib: float | None = None,
    batch_size: int = 4,
    calib_seq: int = 2048,
    recipe: str | Recipe = "presets/nvfp4",
    device: str | None = None,
    dtype: torch.dtype | None = None,
    plans: Iterable[tuple[str, str]] = PLANS,
    residencies: Iterable[str] = RESIDENCIES,
    layerwise: bool = False,
) -> MemoryReport:
    """Estimate every plan x residency at ``world_size`` ranks (``whole`` at 1) from the headers alone.

    ``device``: "cuda" (default when no GPU is visible too: the planner is for planning GPU runs) or
    "cpu" (host RAM holds everything; budget = RAM / ranks).
    """
    layout = read_layout(path)
    the_recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    shape = RunShape(batch_size, calib_seq, the_recipe.name, device or "cuda", dtype, layerwise)
    budget = device_budget(shape.device, world_size, gpu_mem_gib)
    estimates, smallest = [], {}
    for kind, dense in plans:
        for residency in residencies:
            w = 1 if kind == PlanKind.WHOLE else world_size
            est = estimate_asked(layout, Asked(kind, dense, residency, w), shape, recipe=the_recipe,
                                 budget=device_budget(shape.device, w, gpu_mem_gib))
            estimates.append(est)
            smallest[(kind, dense, residency)] = smallest_world(layout, kind, dense, residency, shape, the_recipe,
                                                                gpu_mem_gib)
    return MemoryReport(layout, shape, world_size, budget, estimates, smallest)


# ------------------------------------------------------------------------------ decisions for a run


def check_fits(
    path: str | Path,
    *,
    plan: str,
    world_size: int,
    dense: str = "replicated",
    ep_degree: int | None = None,
    experts: str = "auto",
    gpu_mem_gib: float | None = None,
    batch_size: int = 4,
    calib_seq: int = 2048,
    recipe: str | Recipe = "presets/nvfp4",
    device: str = "cuda",
    dtype: torch.dtype | None = None,
) -> Estimate:
    """The estimate of the run hf_ptq was asked for, with ``experts="auto"`` resolved (packed when bf16
    does not fit); raises ``MemoryPlanError`` before any weight is read when it cannot fit, naming the
    numbers and a configuration that would. Without a known budget nothing is refused. The run's own path:
    the plan ``decide_plan`` makes of the request, then ``fit_plan`` (the preflight's memory check)."""
    layout = read_layout(path)
    the_recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    shape = RunShape(batch_size, calib_seq, the_recipe.name, device, dtype)
    asked = Asked(plan, dense, Residency.BF16 if experts == AUTO else experts, world_size, ep_degree)
    the_plan, why = _refusal(layout, asked._replace(residency=Residency.BF16), shape)
    if the_plan is None:
        return Estimate(asked, None, refused=why)
    try:
        return fit_plan(layout, the_plan, experts, shape, recipe=the_recipe, gpu_mem_gib=gpu_mem_gib)[1]
    except PlanError as err:  # a residency the plan cannot hold (ResidencyError)
        return Estimate(asked, None, refused=str(err))


def _refusal_message(layout: CheckpointLayout, est: Estimate, budget: int, shape: RunShape, recipe: Recipe,
                     gpu_mem_gib: float | None) -> str:
    c = est.plan
    transient, transient_bytes = est.largest_transient
    lines = [
        f"{est.label()} with {c.experts_residency} experts on {c.world_size} rank(s) needs {_size(est.peak)} per rank at "
        f"{est.peak_stage}, but {_size(budget)} is available: resident {_size(est.resident)} (dense "
        f"{_size(est.resident_dense)}, experts {_size(est.resident_experts)}), largest transient {transient} "
        f"{_size(transient_bytes)}, runtime {_size(est.runtime)}; largest module {est.largest_module[0]} "
        f"{_size(est.largest_module[1])}."
    ]
    options = []
    for kind, dense in PLANS:
        for residency in RESIDENCIES:
            alt = estimate_asked(layout, Asked(kind, dense, residency, 1 if kind == PlanKind.WHOLE else c.world_size),
                                 shape, recipe=recipe, budget=budget)
            if alt.fits(budget):
                options.append(f"{alt.label()} with {residency} experts ({_size(alt.peak)})")
    if options:
        lines.append(f"At {c.world_size} rank(s) these fit: " + "; ".join(options) + ".")
    else:
        found = []
        for kind, dense in PLANS[1:]:
            for residency in RESIDENCIES:
                w = smallest_world(layout, kind, dense, residency, shape, recipe, gpu_mem_gib)
                if w:
                    label = plan_label(kind, dense, w, w)  # the EP degree the smallest world would default to
                    found.append((w, f"{w} ranks with {label}, {residency} experts"))
        lines.append(("It fits on " + "; or ".join(text for _, text in sorted(found)[:3]) + ".") if found else
                     "No plan fits at any world size with this budget; lower --batch_size/--calib_seq.")
    lines.append("(modelopt-k3-plan prints the whole table; --gpu_mem_gib sets the budget.)")
    return " ".join(lines)


def resolve_experts(layout: CheckpointLayout, plan: DistributionPlan, shape: RunShape, *, recipe: Recipe,
                    budget: int | None, table: DecisionTable | None = None,
                    decode_chunk: int | None = None) -> Estimate:
    """``experts="auto"`` resolved (once, for the run's shape: hf_ptq's flags, or a library load's defaults): the
    first residency the plan allows (``allowed_residencies``: bf16) when it fits or no budget is known, else
    packed when the plan allows it (not under fsdp2, only for an MXFP4 source: the layout's, which is the
    source check's decision), with its decode chunk (``decode_chunk`` if given, else the largest that fits)."""
    packed_source = layout.packed_source
    allowed = allowed_residencies(plan.kind, packed_source=packed_source)
    est = estimate(layout, plan.with_residency(allowed[0]), shape, recipe=recipe, budget=budget, table=table)
    if budget is None or est.fits(budget) or len(allowed) == 1:
        return est
    return estimate(layout, plan.with_residency(allowed[1], packed_source=packed_source), shape,
                    recipe=recipe, budget=budget, table=table, decode_chunk=decode_chunk)


def fit_plan(layout: CheckpointLayout, plan: DistributionPlan, experts: str, shape: RunShape, *, recipe: Recipe,
             gpu_mem_gib: float | None = None, table: DecisionTable | None = None,
             decode_chunk: int | None = None) -> tuple[DistributionPlan, Estimate]:
    """The run's ``plan`` (decided once, by the preflight) with its experts residency (``experts``: a residency
    or ``auto``, resolved here) and decode chunk, and the estimate of it; raises ``MemoryPlanError`` (the
    numbers and a configuration that would fit) when it cannot fit. Without a known budget nothing is refused.
    The owner's implementation is the plan's (``DistributionPlan.local_experts_implementation``), what is
    quantized the run's decision ``table`` (the preflight's): each decided once. ``decode_chunk``: the packed
    experts' chunk a library caller asked for (``load_pretrained``; ignored for bf16 experts), else the
    largest that fits."""
    budget = device_budget(shape.device, plan.world_size, gpu_mem_gib)
    if experts == AUTO:
        est = resolve_experts(layout, plan, shape, recipe=recipe, budget=budget, table=table,
                              decode_chunk=decode_chunk)
    else:
        chunk = decode_chunk if experts == Residency.PACKED else None
        est = estimate(layout, plan.with_residency(experts, chunk, packed_source=layout.packed_source), shape,
                       recipe=recipe, budget=budget, table=table, decode_chunk=chunk)
    if budget is not None and not est.fits(budget):
        raise MemoryPlanError(_refusal_message(layout, est, budget, shape, recipe, gpu_mem_gib))
    # The decode chunk the estimate chose is one the plan can hold: packed, at least 1 (``estimate``).
    return dataclasses.replace(est.plan, decode_chunk=est.decode_chunk), est


__all__ = [
    "Asked", "Estimate", "MemoryPlanError", "MemoryReport", "RunShape", "check_fits",
    "estimate", "fit_plan", "estimate_asked", "owner_bytes", "plan_label", "plan_memory", "planned", "resolve_experts",
    "smallest_world",
]
