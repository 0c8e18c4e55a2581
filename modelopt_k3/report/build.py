"""Rank 0: the report's data (``report.json``) from the merged per-rank summaries. Pure: dicts in, dict out.

Schema ``modelopt_k3.quant_report`` version 2 (docs/REPORT.md describes every field; version 2 added each
module's ``weight_algorithm``, version 1 reports still load). Fields that
depend on how the run was split (``run.world_size``, ``run.plan``, ``coverage.layers[].routed_by_rank``)
are the only ones that differ between a 1-process run and an expert-parallel run of the same job.
"""

from __future__ import annotations

import math
from typing import Any

from ..numerics.stats import WEIGHT_FIELDS, rel_rms

SCHEMA = "modelopt_k3.quant_report"
VERSION = 2  # 2: modules[] and experts[] carry weight_algorithm
_F = {name: i for i, name in enumerate(WEIGHT_FIELDS)}


def _fraction(part: float, whole: float) -> float | None:
    if isinstance(part, float) and math.isnan(part):
        return None
    return part / whole if whole else 0.0


def weight_summary(rows: list[list[float]]) -> dict[str, Any]:
    """Weight error of one tensor, or of several (experts) taken together, from ``WEIGHT_FIELDS`` rows."""
    sse = sum(r[_F["sse"]] for r in rows)
    ssq = sum(r[_F["ssq"]] for r in rows)
    units = sum(r[_F["units"]] for r in rows)
    amax = max(r[_F["amax"]] for r in rows)
    max_err = max(r[_F["max_abs_err"]] for r in rows)
    underflow = [r[_F["underflow"]] for r in rows]
    return {
        "rel_rms": rel_rms(sse, ssq),
        "max_abs_err": max_err,
        "rel_max_err": max_err / amax if amax else 0.0,  # the largest error relative to the tensor's amax
        "amax": amax,
        "numel": int(sum(r[_F["numel"]] for r in rows)),
        "sse": sse,
        "ssq": ssq,
        "units": int(units),
        "saturated_fraction": _fraction(sum(r[_F["saturated"]] for r in rows), units),
        "underflow_fraction": None if any(math.isnan(u) for u in underflow) else _fraction(sum(underflow), units),
    }


def _input_entry(settings: dict[str, Any] | None, counts: list[int] | None) -> dict[str, Any] | None:
    if settings is None:
        return None
    entry = dict(settings)
    if counts is not None:
        calib_values, calib_above, values, clipped, blocks, underflow = counts
        entry["calibration_values"] = calib_values
        # max calibration: nothing lies above the calibrated amax (the largest value seen on any rank).
        entry["calibration_clip_fraction"] = _fraction(calib_above, calib_values) if calib_values else None
        entry["held_out_values"] = values
        entry["held_out_clip_fraction"] = _fraction(clipped, values) if values else None
        entry["held_out_block_underflow_fraction"] = _fraction(underflow, blocks) if blocks else None
    return entry


def dense_modules(rows: list[dict[str, Any]], inputs: dict[str, Any], counts: dict[str, list[int]]) -> list[dict]:
    out = []
    for row in sorted(rows, key=lambda r: r["name"]):
        q = f"{row['name']}.input_quantizer"
        out.append({"name": row["name"], "kind": "linear", "algo": row["algo"], "calibration": row.get("calibration"),
                    "weight_algorithm": row.get("weight_algorithm"),
                    "weight_format": row["weight_format"],
                    "weight": weight_summary([row["stats"]]), "weight_scale": row["weight_scale"],
                    "input": _input_entry(inputs.get(q), counts.get(q))})
    return out


def expert_modules(merged: list[dict[str, Any]], inputs: dict[str, Any], counts: dict[str, list[int]],
                   fused_of: dict[str, str]) -> list[dict]:
    out = []
    for entry in merged:
        q = f"{entry['module']}.quant.input.{fused_of[entry['projection']]}"
        stats = entry["stats"]
        per_expert = {"expert": entry["experts"],
                      "rel_rms": [rel_rms(r[_F["sse"]], r[_F["ssq"]]) for r in stats],
                      "max_abs_err": [r[_F["max_abs_err"]] for r in stats],
                      "amax": [r[_F["amax"]] for r in stats],
                      "weight_scale": entry["weight_scale"],
                      "saturated_blocks": [int(r[_F["saturated"]]) for r in stats],
                      "underflow_blocks": [None if math.isnan(r[_F["underflow"]]) else int(r[_F["underflow"]])
                                           for r in stats],
                      "blocks": [int(r[_F["units"]]) for r in stats]}
        item = {"name": f"{entry['module']}.*.{entry['projection']}", "module": entry["module"],
                "projection": entry["projection"], "kind": "experts", "algo": entry["algo"],
                "calibration": entry.get("calibration"), "weight_algorithm": entry.get("weight_algorithm"),
                "weight_format": entry["weight_format"], "weight": weight_summary(stats) if stats else None,
                "source": "mxfp4" if entry["requantized"] is not None else None,
                "input": _input_entry(inputs.get(q), counts.get(q)), "per_expert": per_expert}
        if entry["requantized"] is not None:
            per_expert["requantized_blocks"] = entry["requantized"]
            total = sum(per_expert["blocks"])
            item["requantized_blocks"] = sum(entry["requantized"])
            item["lossless_blocks"] = total - item["requantized_blocks"]
        out.append(item)
    return out


def coverage_section(layers, by_rank: list[dict[str, list[int]]], *, min_tokens: int, policy: str,
                     explain) -> dict[str, Any]:
    out = []
    for layer in layers:
        starved = layer.uncovered(min_tokens)
        out.append({
            "module": layer.module, "routed": layer.routed, "handled": layer.handled,
            "routed_by_rank": [ranks.get(layer.module) for ranks in by_rank],
            "calibrate_all_experts": layer.calibrate_all, "scale_dependence": layer.dependence,
            "depends_on_calibration": layer.depends_on_calibration(), "input_scales": layer.input_scales,
            "uncovered": [explain(layer, e, policy) for e in starved],
        })
    return {"min_expert_tokens": min_tokens, "policy": policy, "counted": bool(layers), "layers": out}


def fidelity_section(fidelity) -> tuple[list[dict], dict | None]:
    if fidelity is None:
        return [], None
    layers = [{"name": name, "index": i, "hidden_rel_rms": rel_rms(sse, ssq), "sse": sse, "ssq": ssq}
              for i, (name, (sse, ssq)) in enumerate(zip(fidelity.layers, fidelity.hidden))]
    final = {"kl": fidelity.kl, "top1_agreement": fidelity.top1, "tokens": int(fidelity.tokens)}
    return layers, final


def finite(obj):
    """JSON has no NaN/Inf: they become None (a missing number), everywhere in ``obj``."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj
