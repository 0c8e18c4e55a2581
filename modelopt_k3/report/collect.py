"""Per-rank summaries of a quantized model, and rank 0's merge of them into the report's data.

Each rank summarises only what it owns, as the export writes it: quantized dense Linear ``i`` on rank
``i % world`` (under FSDP2 the weight is gathered to that rank alone, as the export does), routed
experts on the rank that writes them (replica 0 of an EP group; its rows under FSDP2), activation
and token counters for its own share of the data. A summary is per-module scalars and per-expert
rows (a few numbers each), pickled to rank 0 with one ``gather_object``; nothing weight-sized travels.
Rank 0 merges them in name and expert order, so the result does not depend on the world size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..dist.fsdp import gather_to_owner, local_rows
from ..experts.packed import expert_weight_rows
from ..numerics import nvfp4_dequantize
from ..numerics.stats import WEIGHT_FIELDS, weight_rows
from ..quant.modules import ExpertsQuantState, iter_quantizers

EXPERTS_PER_PASS = 16  # experts decoded and compared at a time (bounds the temporaries)


def _block(fmt) -> int | None:
    """The block of two-level (global x per-block) scales, None for formats without them."""
    return fmt.group_size if fmt.per_tensor_scale and fmt.group_size else None


def _dense_row(name: str, module: nn.Module, weight: torch.Tensor, fmt) -> dict[str, Any]:
    wq = module.weight_quantizer
    scale = wq.scale() if wq.fmt.per_tensor_scale else None
    # In fp32: the export's values exactly (fake quant returns its input's dtype, which may round them).
    source = weight.float()
    if wq.passes_through:  # the source's codes and scales, as written
        dq = wq.block_source.dequantize(torch.float32).to(source.device)
    else:
        dq = wq.fmt.fake_quant(wq.weight_to_quantize(source), scale, **wq.searched_scales())
    stats = weight_rows(source.unsqueeze(0), dq.unsqueeze(0), block=_block(wq.fmt), scale=scale)
    return {"name": name, "algo": fmt.algo, "weight_format": str(wq.fmt), "stats": stats[0].tolist(),
            "weight_scale": None if scale is None else float(scale)}


def dense_rows(model: nn.Module, qplan, group, within: Callable[[str], bool] | None = None) -> list[dict[str, Any]]:
    """This rank's share of the quantized dense Linears (of those ``within`` holds, default all; collective under
    FSDP2: every rank joins every gather). The owner is the Linear's place among *all* of them, so a layerwise
    run's rows, taken layer by layer, are the rows each rank takes at once in a resident run."""
    modules = dict(model.named_modules())
    rows = []
    for i, name in enumerate(sorted(qplan.dense)):
        if within is not None and not within(name):
            continue
        owner = i % group.world_size
        weight = gather_to_owner(modules[name].weight, owner)
        if owner == group.rank:
            rows.append(_dense_row(name, modules[name], weight.detach(), qplan.dense[name]))
            rows[-1]["calibration"] = calibration_label(qplan, name)
            rows[-1]["weight_algorithm"] = weight_algorithm(qplan, name)
    return rows


def _parts(n: int) -> Iterator[slice]:
    for start in range(0, n, EXPERTS_PER_PASS):
        yield slice(start, min(start + EXPERTS_PER_PASS, n))


def _source_dequant(wq, proj: str, first: int, part: slice) -> tuple[torch.Tensor, list[int]]:
    """The lossless cast of the source bytes for local experts ``part``, dequantized (fp32), and how many
    blocks of each expert were requantized instead of carried."""
    source = wq.source[0]
    scale = wq.scale()
    out, requantized = [], []
    for j in range(part.start, part.stop):
        w, n_req = source.cast_counted(proj, scale, slice(j, j + 1))
        gs = scale[first + j].reshape(1, 1, 1).to(w.packed.device)
        out.append(nvfp4_dequantize(w.packed, w.block_scale, gs, dtype=torch.float32))
        requantized.append(int(n_req))
    return torch.cat(out), requantized


def expert_rows(name: str, experts: nn.Module, spec, projs: dict) -> list[dict[str, Any]]:
    """One summary per quantized projection of this rank's experts: per-expert weight rows."""
    state: ExpertsQuantState = experts.quant
    rows = local_rows(getattr(experts, spec.experts.projections[0].fused_param))
    ids = list(experts.placement.global_ids(rows))
    out = {p.name: {"module": name, "projection": p.name, "algo": projs[p.name].algo, "experts": ids,
                    "weight_format": str(state.weight[p.fused_param].fmt), "stats": [], "weight_scale": [],
                    "requantized": [] if state.weight[p.fused_param].source is not None else None}
           for p in spec.experts.projections if p.name in projs}
    for part in _parts(len(rows)):
        decoded: dict[str, torch.Tensor] = {}
        idx = slice(rows.start + part.start, rows.start + part.stop)  # indices into the module's expert dim
        for proj in spec.experts.projections:
            if proj.name not in projs:
                continue
            wq = state.weight[proj.fused_param]
            if proj.fused_param not in decoded:
                decoded[proj.fused_param] = expert_weight_rows(experts, proj.fused_param, part).float()
            src = decoded[proj.fused_param].chunk(proj.n_chunks, dim=1)[proj.chunk]
            scale = wq.scale()[idx] if wq.fmt.per_tensor_scale else None
            if wq.source is not None:
                dq, requantized = _source_dequant(wq, proj.name, rows.start, part)
                out[proj.name]["requantized"] += requantized
            else:
                moved = wq.weight_to_quantize(decoded[proj.fused_param], experts=idx).chunk(proj.n_chunks, dim=1)[proj.chunk]
                dq = wq.fmt.fake_quant(moved, None if scale is None else scale.view(-1, 1, 1).to(src.device),
                                       **wq.searched_scales(idx, (proj.chunk, proj.n_chunks)))
            stats = weight_rows(src, dq.to(src.device), block=_block(wq.fmt), scale=scale)
            out[proj.name]["stats"] += stats.tolist()
            out[proj.name]["weight_scale"] += [] if scale is None else scale.tolist()
    return list(out.values())


def activation_counts(model: nn.Module) -> dict[str, list[int]]:
    """Input quantizer name -> this rank's counters (calibration 2, held-out 4)."""
    return {name: q.stats.calib.tolist() + q.stats.held_out.tolist()
            for name, q in iter_quantizers(model) if q.role == "input" and q.stats is not None}


def input_settings(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Input quantizer name -> its format, amax, scale and whether the amax is a recipe constant."""
    out = {}
    for name, q in iter_quantizers(model):
        if q.role != "input":
            continue
        calibrated = q.calibrated
        out[name] = {"format": str(q.fmt), "amax": float(q.amax) if calibrated else None,
                     "scale": float(q.scale()) if calibrated else None, "constant": q.constant_amax is not None}
    return out


def calibration_label(qplan, quantizer_name: str) -> str:
    """What chose a weight's scales: a block-FP8 source's own (passed through, or why not: ``QuantPlan.source_labels``),
    quant/calibrators' labels, or the recipe's algorithm where none is set."""
    if quantizer_name in qplan.source_labels:
        return qplan.source_labels[quantizer_name]
    return qplan.calibration.get(quantizer_name, str(qplan.recipe.algorithm))


def weight_algorithm(qplan, quantizer_name: str) -> str | None:
    """Which algorithm produced a weight's scales, as the calibrator that ran recorded it
    (``calibrators.weight_algorithm_names()``); None where no calibrator recorded one."""
    return qplan.weight_algorithms.get(quantizer_name)


def weight_summary(model: nn.Module, qplan, group,
                   within: Callable[[str], bool] | None = None) -> dict[str, list]:
    """This rank's weight rows (``dense``, ``experts``) of the quantized modules ``within`` holds (default all):
    what needs the weights resident. A layerwise run takes them per layer, before the layer is released, and
    hands their concatenation to ``report`` (the merge sorts by name and expert, so the order does not matter)."""
    info = qplan.load
    spec = info.spec
    experts = []
    if info.placement.experts.writes_experts:
        modules = spec.experts_modules(model)
        fused = {p.name: p.fused_param for p in spec.experts.projections}
        for name, projs in sorted(qplan.experts.items()):
            if within is not None and not within(name):
                continue
            for row in expert_rows(name, modules[name], spec, projs):
                row["calibration"] = calibration_label(qplan, f"{name}.{fused[row['projection']]}")
                row["weight_algorithm"] = weight_algorithm(qplan, f"{name}.{fused[row['projection']]}")
                experts.append(row)
    return {"dense": dense_rows(model, qplan, group, within), "experts": experts}


def rank_summary(model: nn.Module, qplan, group, weights: dict[str, list] | None = None) -> dict[str, Any]:
    """What this rank contributes to the report (call on every rank: dense rows may gather under FSDP2);
    ``weights``: ``weight_summary``'s rows already taken (a layerwise run, whose weights are released)."""
    spec = qplan.load.spec
    weights = weight_summary(model, qplan, group) if weights is None else weights
    routed = {name: m.token_counter.routed.tolist() for name, m in spec.experts_modules(model).items()
              if hasattr(m, "token_counter")}
    return {"rank": group.rank, "dense": weights["dense"], "experts": weights["experts"],
            "activations": activation_counts(model), "routed": routed}


def gather_to_main(obj: Any, group) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 of ``group`` (None elsewhere); pickled, so keep it small."""
    if group.world_size == 1:
        return [obj]
    out = [None] * group.world_size if group.is_main else None
    dist.gather_object(obj, out, dst=0, group=group.pg)
    return out


def merge_experts(parts: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (module, projection): every owner's rows, in global expert order."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for rows in parts:
        for row in rows:
            key = (row["module"], row["projection"])
            if key not in merged:
                merged[key] = {k: v for k, v in row.items() if k not in ("experts", "stats", "weight_scale",
                                                                         "requantized")}
                merged[key]["_rows"] = []
            requantized = row["requantized"] or [None] * len(row["experts"])
            scales = row["weight_scale"] or [None] * len(row["experts"])
            merged[key]["_rows"] += list(zip(row["experts"], row["stats"], scales, requantized))
    out = []
    for key in sorted(merged):
        entry = merged[key]
        rows = sorted(entry.pop("_rows"))
        entry["experts"] = [r[0] for r in rows]
        entry["stats"] = [r[1] for r in rows]
        entry["weight_scale"] = [r[2] for r in rows]
        entry["requantized"] = [r[3] for r in rows] if rows and rows[0][3] is not None else None
        out.append(entry)
    return out


def sum_counts(parts: list[dict[str, list[int]]]) -> dict[str, list[int]]:
    total: dict[str, list[int]] = {}
    for counts in parts:
        for name, values in counts.items():
            total[name] = [a + b for a, b in zip(total.get(name, [0] * len(values)), values)]
    return dict(sorted(total.items()))


__all__ = ["WEIGHT_FIELDS", "gather_to_main", "input_settings", "merge_experts", "rank_summary", "sum_counts", "weight_summary"]
