"""How long a PTQ run takes: a first-order wall-time model of load, calibration and export, before any weight
is read (issue 44 item 1; decision record ``docs/decisions/0009-wall-time-plan.md``).

Two halves, so the arithmetic can be checked by hand and fed measured constants:

* ``workload_of(layout, plan, ...)`` turns what the memory planner reads (``inventory.CheckpointLayout``: the
  bytes each rank reads, its experts, the dense part) and the run's shape (recipe, calibration size, top-k,
  layerwise or resident, EP degree and replicas) into a ``Workload``: bytes, FLOPs and counts per rank, no
  hardware in it.
* ``predict(workload, hardware)`` prices it with ``hardware.Hardware``'s rates (pure arithmetic) into a
  ``WallTime``: each phase as named terms in seconds, its bottleneck the largest term.

What each phase counts, for the busiest rank (replica 0 of the EP group: it also writes the experts):

* **load**: the source bytes this rank reads, streamed through the slowest of the host's disks (shared by the
  host's ranks), one process's reader and the host->device link (they overlap: the largest counts), then the
  decode of MXFP4/FP8 sources into the load dtype (after the read: ``load/pretrained.py`` decodes what it read),
  and a fixed cost per source tensor.
* **calibration**: ``forwards`` passes over this rank's ``calib_size / world`` sequences (max: 1; local_hessian
  and gptq one more; gptq ``true_sequential`` one per stage of a layer). Each pass is a roofline over the
  batches (GEMM FLOPs of the dense Linears and top-k routed experts, plus every expert on every token of the EP
  group under ``calibrate_all_experts``, against streaming the resident weights
  from HBM once per batch) plus the all-to-all bytes (dispatch and combine of every routed row that leaves the
  rank, over NVLink within the domain, else the network; ``calibrate_all_experts`` also gathers the group's
  tokens), a fixed cost per decoder layer per batch and, under the eager experts loop, per expert that receives
  tokens per batch and MoE layer (``grouped_mm`` runs a layer's experts in one call), the packed experts'
  decode per batch, and under ``--layerwise`` each layer's captured inputs through the
  host link (out and back). Then the weight algorithm: the block-scale searches stream their candidates;
  GPTQ factorizes one ``[in, in]`` Hessian per Linear/expert (``4/3 in^3`` FLOPs: Cholesky and inverse) and
  updates the weight (``2 out in^2``).
* **export**: the bytes this rank writes (NVFP4: 4.5 bits a weight; the rest as loaded), through the slowest
  of the device->host link, one process's writer and the host's disks; a fixed cost per tensor written, and
  the served check hf_ptq runs after the export (rank 0 reads every tensor's header and the scales back).
* **start-up**: a fixed cost per run (process, imports, process group, tokenizer, preflight).

First order, stated: the phases do not overlap one another (the code runs them in turn; layerwise reads,
calibrates and writes each layer in turn too); routing is balanced; attention's score FLOPs (quadratic in
``calib_seq``) are not counted (a few percent of the Linear FLOPs at calibration lengths); efficiencies are the
presets' nominal ones. ``benchmarks/bench_wall_time.py`` checks the model against measured runs with
constants measured on the same machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..dist.plan import DistributionPlan, PlanKind, Residency
from ..quant.decisions import DecisionTable
from ..recipe import QuantFormat, Recipe
from .hardware import Hardware
from .inventory import (
    PACKED_CODES,
    PACKED_SCALES,
    SOURCE_SIDE_TENSORS,
    CheckpointLayout,
    dense_format,
    experts_formats,
)
from .planner import MemoryReport, RunShape

# NVFP4 output: 4-bit codes plus one E4M3 scale per 16 weights (4.5 bits a weight).
NVFP4_BYTES_PER_WEIGHT = 0.5 + 1 / 16
F32 = 4
# gptq true_sequential: passes per layer = the stages of an MLA + MoE decoder layer (q_a/kv_a, q_b, kv_b, o;
# shared gate/up, shared down; routed gate/up, routed down), gptq.py's stage rule.
TRUE_SEQUENTIAL_STAGES = 8
E4M3_SCALES = 126  # fp8_scale_sweep: every positive finite E4M3 value is a candidate (nvfp4_search.py)


@dataclass(frozen=True)
class Workload:
    """What one PTQ run asks of its busiest rank, hardware-free (bytes, FLOPs, counts).

    ``tokens``/``batches``: this rank's calibration tokens and batches in one pass; ``forwards``: passes.
    ``resident_weight_bytes``: weights a pass streams from HBM per batch; ``forward_decode_bytes``: packed
    experts decoded per batch. ``a2a_bytes``: per pass, what leaves the rank in the all-to-alls (dispatch and
    combine). ``activation_bytes``: layerwise only, captured inputs moved per pass (to the host and back).
    ``search_bytes``/``factor_flop``/``update_flop``: the weight algorithm after the passes. The counts behind
    the fixed costs: ``source_tensors`` this rank loads, ``expert_calls`` per pass (routed experts that receive
    tokens, summed over batches and MoE layers), ``output_tensors`` this rank writes, ``checked_tensors`` the
    served check reads back (the whole export, on rank 0)."""

    world_size: int
    ep_degree: int
    layerwise: bool
    read_bytes: int
    decode_bytes: int
    write_bytes: int
    writers: int  # ranks that write (every rank writes its dense share; replica 0 also the experts)
    tokens: int
    batches: int
    forwards: int
    layers: int
    resident_weight_bytes: int
    forward_decode_bytes: int
    dense_flop_per_token: float
    expert_flop_per_token: float
    a2a_bytes: int
    activation_bytes: int
    search_bytes: int = 0
    factor_flop: float = 0.0
    update_flop: float = 0.0
    algorithm: str = "max"
    source_tensors: int = 0
    expert_calls: float = 0.0
    output_tensors: int = 0
    checked_tensors: int = 0


@dataclass
class Phase:
    """One phase's terms in seconds. ``streamed``: the terms that overlap (one stream through several links:
    the slowest counts); the others add up. ``bottleneck``: the term that costs the most."""

    name: str
    terms: dict[str, float]
    streamed: tuple[str, ...] = ()

    @property
    def seconds(self) -> float:
        stream = max((self.terms[t] for t in self.streamed), default=0.0)
        return stream + sum(s for t, s in self.terms.items() if t not in self.streamed)

    @property
    def bottleneck(self) -> str:
        return max(self.terms, key=self.terms.get) if self.terms else ""


@dataclass
class WallTime:
    """``predict``'s answer: the phases in run order and the hardware they were priced on."""

    hardware: str
    phases: dict[str, Phase] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(p.seconds for p in self.phases.values())

    def seconds(self, phase: str) -> float:
        return self.phases[phase].seconds

    @property
    def bottleneck(self) -> str:
        """The whole run's: the largest term of any phase, named with its phase."""
        phase, term = max(((p.name, t) for p in self.phases.values() for t in p.terms),
                          key=lambda pt: self.phases[pt[0]].terms[pt[1]], default=("", ""))
        return f"{phase}: {term}" if phase else ""

    def as_dict(self) -> dict:
        """``modelopt-k3-plan --json``'s fields: seconds and bottleneck per phase, the total."""
        out: dict = {"hardware": self.hardware, "total_s": round(self.total, 1), "bottleneck": self.bottleneck}
        for name, p in self.phases.items():
            out[f"{name}_s"] = round(p.seconds, 1)
            out[f"{name}_bottleneck"] = p.bottleneck
        return out


# ------------------------------------------------------------------------------ hardware -> seconds


def _a2a_rate(w: Workload, hw: Hardware) -> float:
    """An EP group inside the NVLink domain exchanges over NVLink; a larger one is bounded by the network."""
    return hw.intra_node_bytes_per_s if w.ep_degree <= hw.nvlink_domain else hw.inter_node_bytes_per_s


def predict(w: Workload, hw: Hardware) -> WallTime:
    """Price ``w`` on ``hw`` (see the module docstring for what each term counts)."""
    per_host = min(w.world_size, hw.gpus_per_host)
    writers_per_host = min(w.writers, hw.gpus_per_host)
    load = Phase("load", {
        "disk read": w.read_bytes * per_host / hw.host_disk_read_bytes_per_s,
        "process read": w.read_bytes / hw.process_read_bytes_per_s,
        "host->device": w.read_bytes / hw.host_link_bytes_per_s,
        "decode": w.decode_bytes / hw.decode_bytes_per_s,
        "per-tensor overhead": w.source_tensors * hw.tensor_load_s,
    }, streamed=("disk read", "process read", "host->device"))
    flop = w.tokens * (w.dense_flop_per_token + w.expert_flop_per_token)
    gemm, hbm = flop / hw.gemm_flop_per_s, w.batches * w.resident_weight_bytes / hw.hbm_bytes_per_s
    per_pass = {
        "GEMM FLOPs": gemm if gemm >= hbm else 0.0,
        "HBM weight reads": hbm if hbm > gemm else 0.0,  # the roofline: the larger of the two counts
        "all-to-all": w.a2a_bytes / _a2a_rate(w, hw) if w.ep_degree > 1 else 0.0,
        "per-layer overhead": w.batches * w.layers * hw.layer_forward_s,
        "per-expert dispatch": w.expert_calls * hw.expert_call_s,
        "packed decode": w.batches * w.forward_decode_bytes / hw.decode_bytes_per_s,
        "activations host<->device": w.activation_bytes / hw.host_link_bytes_per_s,
    }
    calib = {name: w.forwards * s for name, s in per_pass.items() if s}
    if w.search_bytes:
        calib["weight search"] = w.search_bytes / hw.search_bytes_per_s
    if w.factor_flop or w.update_flop:
        calib["GPTQ factorization"] = w.factor_flop / hw.factor_flop_per_s
        calib["GPTQ update"] = w.update_flop / hw.gemm_flop_per_s
    export = Phase("export", {
        "disk write": w.write_bytes * writers_per_host / hw.host_disk_write_bytes_per_s,
        "process write": w.write_bytes / hw.process_write_bytes_per_s,
        "device->host": w.write_bytes / hw.host_link_bytes_per_s,
        "per-tensor overhead": w.output_tensors * hw.tensor_export_s,
        "served check": w.checked_tensors * hw.tensor_check_s,
    }, streamed=("disk write", "process write", "device->host"))
    phases = [Phase("start-up", {"fixed start-up": hw.startup_s}), load, Phase("calibration", calib), export]
    return WallTime(hw.name, {p.name: p for p in phases})


# ------------------------------------------------------------------------------ layout -> workload


def _local_experts(layout: CheckpointLayout, plan: DistributionPlan) -> int:
    """Experts per MoE layer on one rank (the run's placement; fsdp2 shards them by rows, the same share)."""
    if plan.expert_parallel:
        return plan.expert_placement.per_rank
    if plan.kind is PlanKind.FSDP2:
        return -(-layout.num_experts // plan.world_size)
    return layout.num_experts


def _options(recipe: Recipe):
    """The recipe's algorithm as the registry types it (its defaults filled: ``quant.calibrators``)."""
    from ..quant.calibrators import algorithm_config

    return algorithm_config(recipe.algorithm)


def _forwards(recipe: Recipe) -> int:
    """Calibration passes: max's one, plus the Hessian forward(s) of local_hessian and gptq."""
    method, config = recipe.algorithm.method, _options(recipe)
    if method == "local_hessian":
        return 2
    if method == "gptq":
        return 1 + (TRUE_SEQUENTIAL_STAGES if getattr(config, "true_sequential", False) else 1)
    return 1


def _candidates(recipe: Recipe) -> int:
    """Block-scale candidates a search tries per weight (mse, local_hessian; 0: no search)."""
    if recipe.algorithm.method not in ("mse", "local_hessian"):
        return 0
    config = _options(recipe)
    if getattr(config, "fp8_scale_sweep", False):
        return E4M3_SCALES
    if getattr(config, "four_over_six", False):
        return 2
    return math.ceil((config.stop_multiplier - config.start_multiplier) / config.step_size) + 1


def workload_of(layout: CheckpointLayout, plan: DistributionPlan, *, recipe: Recipe, calib_size: int,
                batch_size: int, calib_seq: int, layerwise: bool, dtype: torch.dtype = torch.bfloat16,
                table: DecisionTable | None = None) -> Workload:
    """The ``Workload`` of ``plan`` (the run's distribution plan, residency set) on ``layout`` with this recipe
    and calibration: ``calib_size`` sequences of ``calib_seq`` tokens for the whole run, ``batch_size`` per
    batch per rank; ``dtype``: the load dtype; ``table``: the run's decision table (default: the recipe's,
    decided on the layout's headers as the preflight does)."""
    table = table if table is not None else layout.decision_table(recipe)
    world, b = plan.world_size, dtype.itemsize
    e_local = _local_experts(layout, plan)
    packed = plan.experts_residency is Residency.PACKED
    dense_share = world if plan.fsdp_sharded else 1
    dense_stored = sum(t.nbytes for t in layout.dense)
    carried_stored = sum(t.nbytes for t in layout.carried_tensors)  # never loaded: read and written by the export
    dense_loaded = sum(t.numel * layout.load_dtype(t, dtype).itemsize for t in layout.dense)
    experts_stored = sum(e_local * g.stored_bytes_per_expert for g in layout.experts)
    experts_decoded = sum(e_local * g.decoded_numel_per_expert * b for g in layout.experts)
    # FP8 dense weights are decoded into the load dtype (their F32 block scales are read, not decoded).
    decode_dense = sum(t.numel * b for t in layout.dense if t.dtype.is_floating_point and t.dtype.itemsize == 1)
    decode_experts = 0 if packed or experts_stored == experts_decoded else experts_decoded

    text = layout.text_config
    act = layout.spec.memory.activation_memory(text, 1, 1, b) if layout.spec.memory.activation_memory else None
    top_k = act.top_k if act else 0
    latent = act.latent_dim if act else int(text.get("hidden_size", 0))
    sequences = -(-calib_size // world)
    tokens, batches = sequences * calib_seq, -(-sequences // batch_size)
    linears = {m: o * i for m, (o, i) in layout.linear_weights().items() if "embed" not in m}
    dense_flop = 2.0 * sum(linears.values())
    expert_flop = 2.0 * top_k * sum(g.decoded_numel_per_expert for g in layout.experts)
    moe_layers = len(layout.experts)
    ep = plan.ep_degree if plan.expert_parallel else 1
    # Dispatch and combine: every routed row of this rank's tokens, (ep - 1) / ep of them to another rank.
    a2a = 2 * tokens * top_k * latent * b * moe_layers * (ep - 1) / ep
    if recipe.calibrate_all_experts:
        # Every token of the EP group through every local expert (the planner's ``all_experts_rows``): per rank
        # tokens x ep x local experts = tokens x all experts, after gathering the other ranks' tokens.
        expert_flop += 2.0 * sum(g.num_experts * g.decoded_numel_per_expert for g in layout.experts)
        a2a += tokens * (ep - 1) * latent * b * moe_layers
    layers = int(text.get("num_hidden_layers", moe_layers))
    hidden = int(text.get("hidden_size", 0))

    algorithm = recipe.algorithm.method
    weights = _searched_weights(layout, table, e_local)
    search = sum(n * o * i for o, i, n in weights) * _candidates(recipe) * F32
    factor = update = 0.0
    if algorithm == "gptq":
        factor = sum(n * 4 / 3 * i ** 3 for o, i, n in weights)
        update = sum(n * 2.0 * o * i * i for o, i, n in weights)
    writes_experts = not plan.expert_parallel or plan.expert_placement.writes_experts
    experts_out_tensors = sum(g.num_experts * _tensors_per_expert(table, g, layout.spec) for g in layout.experts)
    dense_out_tensors = _dense_output_tensors(layout, table)
    out_experts = sum(e_local * o * i * _output_bytes_per_weight(experts_formats(table, g, layout.spec).get(p), b)
                      for g in layout.experts for p, (o, i) in g.fused_shapes(layout.spec).items())
    return Workload(
        world_size=world, ep_degree=ep, layerwise=layerwise,
        read_bytes=(dense_stored + carried_stored) // dense_share + experts_stored,
        decode_bytes=decode_dense // dense_share + decode_experts,
        write_bytes=int((out_experts if writes_experts else 0)
                        + (_dense_output(layout, table, dtype) + carried_output_bytes(layout, b)) / world),
        writers=world, tokens=tokens, batches=batches, forwards=_forwards(recipe), layers=layers,
        resident_weight_bytes=dense_loaded // dense_share + (experts_stored if packed else experts_decoded),
        forward_decode_bytes=experts_decoded if packed else 0,
        dense_flop_per_token=dense_flop, expert_flop_per_token=expert_flop, a2a_bytes=int(a2a),
        activation_bytes=2 * tokens * hidden * b * layers if layerwise else 0,
        search_bytes=int(search), factor_flop=factor, update_flop=update, algorithm=algorithm,
        source_tensors=round((len(layout.dense) + len(layout.carried_tensors)) / dense_share
                             + sum(e_local * g.stored_tensors_per_expert for g in layout.experts)),
        expert_calls=batches * sum(_experts_hit(g, e_local, ep, tokens / max(batches, 1), top_k,
                                                recipe.calibrate_all_experts) for g in layout.experts)
        if plan.local_experts_implementation == "eager" else 0.0,  # grouped_mm: one call per projection
        output_tensors=round((experts_out_tensors * e_local / max(layout.num_experts, 1) if writes_experts else 0)
                             + dense_out_tensors / world),
        checked_tensors=experts_out_tensors + dense_out_tensors)


def _experts_hit(group, e_local: int, ep: int, batch_tokens: float, top_k: int, all_experts: bool) -> float:
    """Expected local experts that receive tokens in one batch of one MoE layer: the EP group's routed rows
    for this rank's experts, spread uniformly (balanced routing) over them; every one under
    ``calibrate_all_experts``. Counted only for the eager loop (one call per expert); ``grouped_mm`` runs a
    layer's experts in one call per projection, inside the per-layer overhead."""
    if all_experts or not e_local:
        return float(e_local)
    rows = batch_tokens * ep * top_k * e_local / max(group.num_experts, 1)
    return e_local * (1 - (1 - 1 / e_local) ** rows)


def _tensors_per_weight(fmt: QuantFormat | None, shape: tuple[int, int]) -> int:
    """Tensors the export writes for one ``[out, in]`` weight in ``fmt``: the weight alone where it stays as
    loaded, else its scheme's declared layout (the exporters' own: weight tensors, then ``input_scale``)."""
    return 1 if fmt is None else len(fmt.scheme.layout(shape))


def _tensors_per_expert(table: DecisionTable, group, spec) -> int:
    """Tensors the export writes per routed expert (one prefix per checkpoint projection, ``_expert_tensors``)."""
    formats = experts_formats(table, group, spec)
    return sum(_tensors_per_weight(formats.get(proj.fused_param), group.projections[proj.name])
               for proj in spec.experts.projections)


def _dense_output_tensors(layout: CheckpointLayout, table: DecisionTable) -> int:
    """Tensors of the dense part and the carried modules in the export (a quantized Linear's weight becomes its
    format's tensors; everything else is written once)."""
    total = len(layout.carried_tensors)
    for t in layout.dense:
        linear = t.name.endswith(".weight") and len(t.shape) == 2
        total += _tensors_per_weight(dense_format(table, t.module), tuple(t.shape)) if linear else 1
    return total


def _searched_weights(layout: CheckpointLayout, table: DecisionTable, e_local: int) -> list[tuple[int, int, int]]:
    """(out, in, copies on this rank) of every NVFP4 weight the weight algorithm visits: dense NVFP4 Linears and
    this rank's routed experts that are not the lossless MXFP4 cast (the planner's ``_algorithm_state`` rule)."""
    from ..quant.schemes import NVFP4_TENSOR

    out: list[tuple[int, int, int]] = []
    for module, (o, i) in layout.linear_weights().items():
        fmt = dense_format(table, module)
        if fmt is not None and fmt.weights is NVFP4_TENSOR:
            out.append((o, i, 1))
    for g in layout.experts:
        if g.packed:
            continue
        formats = experts_formats(table, g, layout.spec)
        out += [(o, i, e_local) for p, (o, i) in g.fused_shapes(layout.spec).items()
                if formats.get(p) is not None and formats[p].weights is NVFP4_TENSOR]
    return out


def _output_bytes_per_weight(fmt: QuantFormat | None, unquantized: float) -> float:
    """Exported bytes per weight in ``fmt`` (the decision table's): NVFP4 4.5 bits, FP8 one byte (its scales
    are negligible), ``unquantized`` where it stays as loaded."""
    from ..quant.schemes import NVFP4_TENSOR

    if fmt is None:
        return unquantized
    return NVFP4_BYTES_PER_WEIGHT if fmt.weights is NVFP4_TENSOR else 1.0


def _dense_output(layout: CheckpointLayout, table: DecisionTable, dtype: torch.dtype) -> float:
    """Bytes of the dense part in the export: the table's format for Linear weights, the rest as loaded."""
    total = 0.0
    for t in layout.dense:
        loaded = layout.load_dtype(t, dtype).itemsize
        linear = t.name.endswith(".weight") and len(t.shape) == 2
        total += t.numel * (_output_bytes_per_weight(dense_format(table, t.module), loaded) if linear else loaded)
    return total


def carried_output_bytes(layout: CheckpointLayout, b: int) -> int:
    """Bytes of the carried modules in the export (``source_decode.carried_items``): a block-FP8 or INT4
    pack-quantized weight decoded into the load dtype (``b`` bytes; its scales and stored shape consumed), every
    other tensor as stored."""
    total = 0
    for t in layout.carried_tensors:
        part = t.name.rpartition(".")[2]
        if part == "weight" and t.dtype.is_floating_point and t.dtype.itemsize == 1:
            total += t.numel * b
        elif part == PACKED_CODES and t.dtype == torch.int32:  # eight 4-bit values a word
            total += t.numel * 8 * b
        elif part not in (PACKED_SCALES, *SOURCE_SIDE_TENSORS):
            total += t.nbytes
    return total


# ------------------------------------------------------------------------------ the plan's times


def predict_run(layout: CheckpointLayout, plan: DistributionPlan, shape: RunShape, *, recipe: Recipe,
                calib_size: int, hardware: Hardware, table: DecisionTable | None = None) -> WallTime:
    """The wall time of one planned run: ``shape`` (the memory planner's: batch, sequence, dtype, layerwise)
    with ``calib_size`` sequences in all, on ``hardware``; ``table``: the run's decision table."""
    dtype = shape.dtype or layout.config_dtype
    work = workload_of(layout, plan, recipe=recipe, calib_size=calib_size, batch_size=shape.batch_size,
                       calib_seq=shape.calib_seq, layerwise=shape.layerwise, dtype=dtype, table=table)
    return predict(work, hardware)


def _duration(seconds: float) -> str:
    """``seconds`` as a person reads a wall time: 42 s, 12.5 min, 3.2 h."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


@dataclass
class TimePlan:
    """``modelopt-k3-plan --time``: each configuration of a ``MemoryReport`` priced on one hardware (None where
    the run would refuse it)."""

    report: MemoryReport
    hardware: Hardware
    calib_size: int
    times: list[WallTime | None]

    def rows(self) -> list[dict]:
        """The memory rows (``MemoryReport.rows``) with a ``time`` object each (``WallTime.as_dict``)."""
        return [{**row, "time": t.as_dict() if t else None} for row, t in zip(self.report.rows(), self.times)]

    def table(self) -> str:
        shape = self.report.shape
        lines = [
            f"Wall time on {self.hardware.name} ({self.hardware.gpus_per_host} GPUs per host): calibration "
            f"{self.calib_size} x {shape.calib_seq} tokens in all, batch {shape.batch_size} per rank, "
            + ("layerwise, " if shape.layerwise else "resident, ") + f"recipe {shape.recipe}; first-order "
            "(memory/wall_time.py), each phase with its bottleneck",
            "",
            "| plan | experts | ranks | fits | start-up | load | calibration | export | total | bottleneck |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        fits = {True: "yes", False: "**no**", None: "?"}
        for e, t in zip(self.report.estimates, self.times):
            c = e.asked
            if t is None:
                lines.append(f"| {e.label()} | {c.residency} | {c.world_size} | refused ||||||")
                continue
            cells = [f"{_duration(p.seconds)} ({p.bottleneck})" if name != "start-up" else _duration(p.seconds)
                     for name, p in t.phases.items()]
            lines.append(f"| {e.label()} | {c.residency} | {c.world_size} | {fits[e.fits(self.report.budget)]} | "
                         + " | ".join(cells) + f" | {_duration(t.total)} | {t.bottleneck} |")
        lines.append("")
        lines.append(f"Hardware: {self.hardware.source}; storage and fixed costs are assumptions "
                     "(memory/hardware.py; --disk_gbps, --disk_write_gbps, --net_gbps override them).")
        return "\n".join(lines)


def time_plan(report: MemoryReport, hardware: Hardware, calib_size: int) -> TimePlan:
    """Price every configuration the memory planner estimated (``plan_memory``) on ``hardware``."""
    from ..recipe import load_recipe

    recipe = load_recipe(report.shape.recipe)
    times = [None if e.refused or e.plan is None else
             predict_run(report.layout, e.plan, report.shape, recipe=recipe, calib_size=calib_size, hardware=hardware)
             for e in report.estimates]
    return TimePlan(report, hardware, calib_size, times)


__all__ = ["Phase", "TimePlan", "WallTime", "Workload", "predict", "predict_run", "time_plan", "workload_of"]
