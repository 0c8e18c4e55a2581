"""The quantization report: what quantization did to each module, layer and expert, and which experts
calibration reached (``report.json``, ``report.md``, PNG plots). See docs/REPORT.md.

``report_planned(model, qplan, out_dir, group=...)`` runs on every rank of a quantized model; each rank
summarises what it owns (``collect.py``), rank 0 merges and writes. ``report(model, out_dir, ...)`` is the
library's convenience over it (the plan ``quantize`` left on the model, the current run group). The numbers
are pure functions (``stats.py``); the files come from the JSON alone (``render.py``), so
``modelopt-k3-report`` re-renders them.
Imports are lazy: the report sits above ``quant/``, whose modules it imports only when it runs.
"""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path
from typing import Any

REPORT_JSON = "report.json"
DEFAULT_DIR = "quant_report"  # under the export directory


def report(
    model,
    out_dir: str | Path | None,
    *,
    held_out: list | None = None,
    fidelity=None,
    coverage=None,
    min_expert_tokens: int = 1,
    uncovered_experts: str = "refuse",
    run: dict[str, Any] | None = None,
    weights: dict[str, list] | None = None,
) -> dict[str, Any] | None:
    """Build the report of a quantized ``model`` and (rank 0) write it into ``out_dir``.

    Call on every rank (it gathers). ``held_out``: this rank's held-out batches of token ids, for the
    per-layer hidden-state error, KL and top-1 agreement (two forwards per batch); or ``fidelity``, an
    ``evaluate_fidelity`` result already computed (hf_ptq shares the ``--eval_kl`` pass). ``coverage``:
    ``expert_coverage``'s result when already computed. ``weights``: this rank's ``collect.weight_summary``
    rows when already taken (a layerwise run takes them layer by layer, before releasing each; with
    ``fidelity`` and ``coverage`` from its streamed passes, nothing here reads a weight or runs a forward).
    ``out_dir`` None: only return the data.
    Returns the report's data on rank 0, None on the other ranks.
    """
    from ..dist.group import current_group
    from ..quant.api import quantized_plan

    return report_planned(model, quantized_plan(model, "report"), out_dir, group=current_group(),
                          held_out=held_out, fidelity=fidelity, coverage=coverage, min_expert_tokens=min_expert_tokens,
                          uncovered_experts=uncovered_experts, run=run, weights=weights)


def report_planned(
    model,
    qplan,
    out_dir: str | Path | None,
    *,
    group,
    held_out: list | None = None,
    fidelity=None,
    coverage=None,
    min_expert_tokens: int = 1,
    uncovered_experts: str = "refuse",
    run: dict[str, Any] | None = None,
    weights: dict[str, list] | None = None,
) -> dict[str, Any] | None:
    """The report stage: ``report``'s work on ``model`` quantized per ``qplan`` (the ``QuantPlan``, which holds
    the load), every rank of ``group``; the arguments as ``report``'s."""
    from ..quant.coverage import expert_coverage, uncovered_explanation
    from ..quant.evaluate import evaluate_fidelity
    from . import build, collect

    info = qplan.load
    if coverage is None:
        coverage = expert_coverage(model, info.spec)
    # Weights first: under FSDP2 a fake-quant forward leaves MXFP4-sourced experts' scales unusable for
    # indexing by module row (seen in the fsdp2 hf_ptq test; not root-caused), so nothing reads them after it.
    summary = collect.rank_summary(model, qplan, group, weights)
    if fidelity is None and held_out:
        fidelity = evaluate_fidelity(model, info.spec.decoder_layers(model), held_out, info.plan.device)
    summary["activations"] = collect.activation_counts(model)  # with the held-out pass's counts
    parts = collect.gather_to_main(summary, group)
    if not group.is_main:
        return None
    inputs = collect.input_settings(model)
    counts = collect.sum_counts([p["activations"] for p in parts])
    fused_of = {p.name: p.fused_param for p in info.spec.experts.projections}
    layers, final = build.fidelity_section(fidelity)
    data = {
        "schema": build.SCHEMA, "version": build.VERSION,
        "run": {"checkpoint": str(info.checkpoint), "recipe": qplan.recipe.name,
                "world_size": group.world_size, "plan": re.sub(r" rank=\d+", "", info.plan.describe()),
                "held_out_sequences": None, **(run or {})},
        "modules": build.dense_modules([r for p in parts for r in p["dense"]], inputs, counts),
        "experts": build.expert_modules(collect.merge_experts([p["experts"] for p in parts]), inputs, counts,
                                        fused_of),
        "coverage": build.coverage_section(coverage, [p["routed"] for p in parts], min_tokens=min_expert_tokens,
                                           policy=uncovered_experts, explain=uncovered_explanation),
        "layers": layers, "final": final,
    }
    data = build.finite(data)
    if out_dir is not None:
        write_report(data, Path(out_dir))
    return data


REPORT_FILES = (REPORT_JSON, "report.md", "error_by_layer.png", "expert_tokens.png", "worst_modules.png")


def write_report(data: dict[str, Any], out_dir: Path) -> list[Path]:
    """``report.json`` plus what ``render`` makes of it, through ``paths.write_owned`` (each file created new and
    renamed into place: never through a link planted there, never over a file we did not write, never into a
    checkpoint directory)."""
    from ..files.paths import write_owned
    from .render import render_files

    body = (json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()
    return write_owned(out_dir, {REPORT_JSON: body, **render_files(data)}, flag="the report directory")


def check_report_dir(out_dir: Path, *, flag: str) -> None:
    """What ``write_report`` will refuse, said before any work (hf_ptq's preflight, ``modelopt-k3-report --out``)."""
    from ..files.paths import OWNED_RECORD, check_owned_dir

    check_owned_dir(Path(out_dir), (*REPORT_FILES, OWNED_RECORD), flag=flag)


def load_report(path: str | Path) -> tuple[dict[str, Any], Path]:
    """A report's data and its directory, from ``report.json``, its directory, or an export holding
    ``quant_report/``; refuses another schema or a newer version."""
    from ..checkpoint import read_json
    from .build import SCHEMA, VERSION

    path = Path(path)
    for candidate in (path, path / REPORT_JSON, path / DEFAULT_DIR / REPORT_JSON):
        if candidate.is_symlink() or (candidate.exists() and not candidate.is_dir()):
            data = read_json(candidate)  # the one validating reader: regular file, bounded, strict JSON
            if not isinstance(data, dict):
                raise ValueError(f"{candidate} is not a JSON object (a {type(data).__name__})")
            if data.get("schema") != SCHEMA or not isinstance(data.get("version"), int) or data["version"] > VERSION:
                raise ValueError(f"{candidate} is not a {SCHEMA} report of version <= {VERSION} "
                                 f"(schema {data.get('schema')!r}, version {data.get('version')!r})")
            return data, candidate.parent
    raise FileNotFoundError(f"no {REPORT_JSON} at {path}, {path / REPORT_JSON} or {path / DEFAULT_DIR / REPORT_JSON}")


__all__ = ["DEFAULT_DIR", "REPORT_FILES", "REPORT_JSON", "check_report_dir", "load_report", "report", "write_report"]


class _CallableModule(types.ModuleType):
    """``modelopt_k3.report(...)`` is the public call (README), and ``modelopt_k3.report`` is also this
    package: once it is imported the attribute is the module, so the module itself calls ``report``."""

    def __call__(self, *args, **kwargs):
        return report(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
