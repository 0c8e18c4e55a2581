"""``modelopt-k3-check``: would vLLM, SGLang and TensorRT-LLM serve this checkpoint as calibrated?

``check_export(export_dir, engines)`` replays each engine's loading of an export from its
safetensors headers, its two JSON configs and a few small tensors (per-tensor scales; whole
weights only where an engine requantizes), one tensor at a time: name mapping into the engine's
parameters, the method the engine builds per layer, the tensors that method expects, and what the
engine does with fused layers' and experts' scales. ``check_recipe_for_engines`` asks the same
rules of a recipe before any weight is read (names and headers only).

Verdict per engine: ``loads correctly`` / ``loads but serves different numbers`` (the layers and
the largest relative change) / ``refuses`` (the first failing tensor and why), and where users meet a failure
otherwise, its own kind: ``server cannot start``, ``loads silently but serves garbage``, ``loads, but the MTP
drafter does not load`` -- each under its serving rule's name (``checkpoint.serving_rules``, docs/SERVING_RULES.md).
"""

from __future__ import annotations

import math
from pathlib import Path

from ..checkpoint import CheckpointError, read_config, read_json
from ..checkpoint.serving_rules import (
    RULES,
    WARNS,
    Finding,
    export_side_findings,
    implausible_input_scales,
)
from ..recipe import Recipe, load_recipe
from ..spec import ModelSpec, ServingSpec
from .engines import ENGINE_NAMES, kv_scale_names, parse_engines, replay, serving_spec
from .layout import Layout, planned_layout, scan_export
from .report import DIFFERENT, LOADS, REFUSES, CheckReport, Deviation, EngineRefusal, EngineResult, Refusal

DEFAULT_ENGINES = ("vllm", "sglang")

__all__ = [
    "DEFAULT_ENGINES",
    "DIFFERENT",
    "ENGINE_NAMES",
    "LOADS",
    "REFUSES",
    "CheckReport",
    "EngineRefusal",
    "EngineResult",
    "Layout",
    "check_export",
    "check_layout",
    "check_recipe_for_engines",
    "final_check",
    "parse_engines",
    "planned_layout",
    "scan_export",
]


def check_layout(layout: Layout, engines=DEFAULT_ENGINES, *, numerics: bool = True,
                 serving: ServingSpec | None = None) -> CheckReport:
    """Each engine's replay of ``layout`` (``serving``: the model's declarations, when the caller holds its spec).
    A module stored quantized that is no Linear (``Layout.quantized_non_linears``) is refused by every engine:
    each builds it as a plain parameter and would load the codes as its values."""
    results = {e: replay(e, layout, numerics=numerics, serving=serving) for e in parse_engines(engines)}
    # A scale with no weight beside it (one written under a wrong prefix) is no module: vLLM's load_weights skips
    # scale names without a parameter, and the Linear that lacks it is judged instead (fp8-weight-scale-missing).
    stored = [n for n in layout.quantized_non_linears
              if f"{n}.weight" in layout.tensors or f"{n}.weight_packed" in layout.tensors]
    for result in results.values():
        result.refusals[:0] = [Refusal(f"{name}.weight", "stored quantized, but no engine builds it as a quantizable "
                                       "Linear (a router, an embedding or a norm is a plain parameter): its codes "
                                       "would be loaded as values") for name in stored]
    return CheckReport(layout.source, results)


def check_export(export_dir: str | Path, engines=DEFAULT_ENGINES, *, source: str | Path | None = None,
                 block_scales: bool = True) -> CheckReport:
    """Replay each engine's loading of ``export_dir``; ``report.ok`` when every engine loads it correctly.

    Then the rules an export's files decide (``checkpoint.serving_rules``: tokenizer and sidecars, MTP layers,
    every block scale, implausible activation scales) join each engine's verdict under their names. ``source``:
    the checkpoint the export was made from (default: the one a converter's completion marker records), for the
    sidecar files it had. ``block_scales`` False: skip reading every block scale (the exporters did, before
    publishing)."""
    from .completeness import check_complete, check_scales

    layout, reader = scan_export(export_dir)
    with reader:
        check_complete(export_dir, reader)  # every tensor the model needs, before any engine "loads"
        check_scales(export_dir, reader)  # and no per-tensor scale that serves zeros or NaN
        report = check_layout(layout, engines)
        source = recorded_source(export_dir) if source is None else source
        findings = export_side_findings(export_dir, reader, layout.config, source, block_scales=block_scales)
        offset = serving_spec(str(layout.config.get("model_type", ""))).norm_weight_offset
        attach_findings(report, [*findings, *implausible_input_scales(reader, offset)])
        return report


def recorded_source(export_dir: str | Path) -> Path | None:
    """The source a converter's completion marker names, when it is still there (else None)."""
    from ..convert import COMPLETE_MARKER

    marker = Path(export_dir) / COMPLETE_MARKER
    if not marker.is_file():
        return None
    try:
        src = Path(str(read_json(marker).get("src", "")))
    except (CheckpointError, AttributeError):
        return None
    return src if src.name and src.is_dir() else None


def attach_findings(report: CheckReport, findings: list[Finding]) -> None:
    """Each finding into the verdict of every engine its rule applies to: a warning, a deviation (its error not
    a number) or a refusal of the rule's kind."""
    for engine, result in report.results.items():
        for f in findings:
            r = RULES[f.rule]
            if engine not in r.engines:
                continue
            if r.verdict == WARNS:
                result.warnings.append(str(f))
            elif r.verdict == DIFFERENT:
                result.deviations.append(Deviation(f.where, f.what, math.nan, rule=f.rule))
            else:
                result.refusals.append(Refusal(f.where, f.what, verdict=r.verdict, rule=f.rule))


def check_recipe_for_engines(checkpoint: str | Path, recipe: Recipe | str, engines, *, reader=None, table=None,
                             config: dict | None = None, spec: ModelSpec | None = None) -> None:
    """Refuse (``EngineRefusal``) a recipe that a named engine cannot serve on ``checkpoint``.

    Works from the checkpoint's config and safetensors headers and the recipe only (no model, no
    weight read): the export the recipe would produce is declared by the exporters' own layout
    functions and judged by the same engine rules as ``check_export``. Differences that need the
    calibrated values (unshared scales) cannot be seen here; everything structural can. ``reader``,
    ``table``, ``config`` and ``spec``: the run's, already decided (hf_ptq's preflight; else read and decided here).
    """
    if isinstance(recipe, str):
        recipe = load_recipe(recipe)
    names = parse_engines(engines)
    config = read_config(Path(checkpoint)) if config is None else config
    serving = spec.serving if spec is not None else None
    layout = planned_layout(checkpoint, recipe, kv_scale_names=kv_scale_names(config, serving), reader=reader,
                            table=table, config=config)
    report = check_layout(layout, names, numerics=False, serving=serving)
    if report.ok:
        return
    failing = [n for n, r in report.results.items() if not r.ok]
    lines = [f"recipe {recipe.name} cannot be served as calibrated by {', '.join(failing)}:"]
    for name in failing:
        lines.append(f"{name}:")
        lines += report.results[name].details()
    lines.append("Keep those layers BF16 (or drop kv_cache) in the recipe, or target other engines.")
    raise EngineRefusal("\n".join(lines))


def final_check(export_dir: str | Path, target_engines=(), *, say=print, source: str | Path | None = None) -> int:
    """What the exporting CLIs run last: check every engine, print the table, return the exit status.

    The status follows only ``target_engines`` (0 when each of them loads the export correctly):
    an engine the user did not target never turns a good export into a failure.
    """
    # The exporters read every block scale before publishing (refuse_unservable): not a second time here.
    report = check_export(export_dir, ENGINE_NAMES, source=source, block_scales=False)
    say(report.table(details=set(target_engines)))  # the details of untargeted engines are one command away
    others = [e for e, r in report.results.items() if not r.ok and e not in target_engines]
    if others:
        say(f"(details: modelopt-k3-check {export_dir} --engine {','.join(others)})")
    failed = [e for e in target_engines if not report.results[e].ok]
    if failed:
        say(f"modelopt-k3-check: target engine(s) {', '.join(failed)} would not serve {export_dir} as calibrated")
    return 1 if failed else 0
