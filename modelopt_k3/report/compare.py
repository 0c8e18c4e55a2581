"""Two quantization reports of one checkpoint side by side (``modelopt-k3-report --compare A B``).

Per quantized module the weight error (relative RMS of the dequantized export vs the source), per decoder
layer the held-out hidden-state error, and the final logits' KL and top-1 agreement, each of A and of B with
the ratio B/A. Pure: two report dicts in, one comparison dict out (``compare.json``); ``markdown`` and
``plot`` draw it. A and B must be reports of the same checkpoint over the same quantized modules (and, where
both have a held-out pass, the same decoder layers); anything else is refused naming what differs.
Version 1 reports (before ``weight_algorithm``) compare too; their algorithm column says ``-``.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import IO, Any

from .render import _figure, _layer_index, _num, _pct, weight_algorithm_text

SCHEMA = "modelopt_k3.quant_report_compare"
VERSION = 1
COMPARE_FILES = ("compare.md", "compare.json", "compare.png")
SHOWN = 8  # names listed in a refusal before "and N more"


class CompareError(ValueError):
    """A and B cannot be compared (different checkpoints, modules or layers; a field of the wrong type)."""


def ratio(a: Any, b: Any) -> float | None:
    """``b / a``; None where either is missing or ``a`` is 0 (an exact A, e.g. a lossless cast, has no ratio)."""
    if not _is_num(a) or not _is_num(b) or a == 0:
        return None
    return b / a


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def _field(entry: Any, key: str, types: tuple[type, ...], where: str) -> Any:
    if not isinstance(entry, dict):
        raise CompareError(f"{where} is not a JSON object (a {type(entry).__name__})")
    value = entry.get(key)
    if value is not None and (not isinstance(value, types) or isinstance(value, bool) and bool not in types):
        raise CompareError(f"{where}.{key} is a {type(value).__name__}, not a {' or '.join(t.__name__ for t in types)}")
    return value


def _modules(data: dict[str, Any], side: str) -> dict[str, dict[str, Any]]:
    """name -> {kind, weight_algorithm, rel_rms, max_abs_err} of every quantized module of one report."""
    out: dict[str, dict[str, Any]] = {}
    for section in ("modules", "experts"):
        entries = _field(data, section, (list,), side)
        for i, m in enumerate(entries or []):
            where = f"{side} {section}[{i}]"
            name = _field(m, "name", (str,), where)
            if name is None:
                raise CompareError(f"{where} has no name")
            if name in out:
                raise CompareError(f"{side} lists module {name} twice")
            weight = _field(m, "weight", (dict,), where) or {}
            out[name] = {"kind": _field(m, "kind", (str,), where) or section,
                         "weight_algorithm": _field(m, "weight_algorithm", (str,), where),
                         "rel_rms": _field(weight, "rel_rms", (int, float), f"{where}.weight"),
                         "max_abs_err": _field(weight, "max_abs_err", (int, float), f"{where}.weight")}
    return out


def _layers(data: dict[str, Any], side: str) -> list[tuple[str, float | None]]:
    layers = _field(data, "layers", (list,), side) or []
    out = []
    for i, r in enumerate(layers):
        name = _field(r, "name", (str,), f"{side} layers[{i}]")
        out.append((name, _field(r, "hidden_rel_rms", (int, float), f"{side} layers[{i}]")))
    return out


def _final(data: dict[str, Any], side: str) -> dict[str, Any] | None:
    final = _field(data, "final", (dict,), side)
    if final is None:
        return None
    return {k: _field(final, k, (int, float), f"{side} final") for k in ("kl", "top1_agreement", "tokens")}


def _side(data: dict[str, Any], where: str, path: str) -> dict[str, Any]:
    run = _field(data, "run", (dict,), where) or {}
    return {"path": path, "checkpoint": _field(run, "checkpoint", (str,), f"{where} run"),
            "recipe": _field(run, "recipe", (str,), f"{where} run"), "version": data.get("version")}


def _order(name: str) -> tuple[int, str]:
    i = _layer_index(name)
    return (-1 if i is None else i, name)


def compare(a: dict[str, Any], b: dict[str, Any], *, a_path: str = "A", b_path: str = "B",
            any_checkpoint: bool = False) -> dict[str, Any]:
    """The comparison of report ``a`` (the baseline) and report ``b``: every ratio is B / A.

    Refused (``CompareError``): different ``run.checkpoint`` (unless ``any_checkpoint``: the same model at two
    paths), a module quantized in one and not the other (named), different decoder layers in the two held-out
    passes. Sections one side lacks (no held-out pass) are left out and listed in ``not_compared``.
    """
    side_a, side_b = _side(a, f"A ({a_path})", a_path), _side(b, f"B ({b_path})", b_path)
    if not any_checkpoint and side_a["checkpoint"] != side_b["checkpoint"]:
        raise CompareError(f"A and B are reports of different checkpoints: A ({a_path}) of {side_a['checkpoint']}, "
                           f"B ({b_path}) of {side_b['checkpoint']} (--any_checkpoint compares the same model "
                           "stored at two paths)")
    mods_a, mods_b = _modules(a, f"A ({a_path})"), _modules(b, f"B ({b_path})")
    only_a, only_b = sorted(set(mods_a) - set(mods_b), key=_order), sorted(set(mods_b) - set(mods_a), key=_order)
    if only_a or only_b:
        parts = ([f"{len(only_a)} only in A ({a_path}): {_names(only_a)}"] if only_a else []) + \
                ([f"{len(only_b)} only in B ({b_path}): {_names(only_b)}"] if only_b else [])
        raise CompareError("A and B quantized different modules: " + "; ".join(parts))
    modules = []
    for name in sorted(mods_a, key=_order):
        ma, mb = mods_a[name], mods_b[name]
        modules.append({"name": name, "kind": ma["kind"],
                        "a": {k: ma[k] for k in ("weight_algorithm", "rel_rms", "max_abs_err")},
                        "b": {k: mb[k] for k in ("weight_algorithm", "rel_rms", "max_abs_err")},
                        "rel_rms_ratio": ratio(ma["rel_rms"], mb["rel_rms"]),
                        "max_abs_err_ratio": ratio(ma["max_abs_err"], mb["max_abs_err"])})
    not_compared = []
    layers_a, layers_b = _layers(a, f"A ({a_path})"), _layers(b, f"B ({b_path})")
    layers = []
    if layers_a and layers_b:
        names_a, names_b = [n for n, _ in layers_a], [n for n, _ in layers_b]
        if names_a != names_b:
            diff = sorted(set(names_a) ^ set(names_b), key=_order) or names_a
            raise CompareError(f"A ({a_path}) and B ({b_path}) measured different decoder layers "
                               f"({len(names_a)} vs {len(names_b)}; differing: {_names(diff)})")
        layers = [{"name": n, "index": i, "a": ea, "b": eb, "ratio": ratio(ea, eb)}
                  for i, ((n, ea), (_, eb)) in enumerate(zip(layers_a, layers_b))]
    else:
        not_compared.append("per-layer hidden-state error: " + _missing(layers_a, layers_b))
    final_a, final_b = _final(a, f"A ({a_path})"), _final(b, f"B ({b_path})")
    final = None
    if final_a and final_b:
        final = {k: {"a": final_a[k], "b": final_b[k], "ratio": ratio(final_a[k], final_b[k])}
                 for k in ("kl", "top1_agreement")}
        final["tokens"] = {"a": final_a["tokens"], "b": final_b["tokens"]}
    else:
        not_compared.append("final logits (KL, top-1): " + _missing(final_a, final_b))
    return {"schema": SCHEMA, "version": VERSION, "a": side_a, "b": side_b, "summary": _summary(modules),
            "modules": modules, "layers": layers, "final": final, "not_compared": not_compared}


def _missing(a: Any, b: Any) -> str:
    which = [s for s, v in (("A", a), ("B", b)) if not v]
    return f"{' and '.join(which)} had no held-out pass"


def _summary(modules: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [m["rel_rms_ratio"] for m in modules if m["rel_rms_ratio"] is not None]
    positive = [r for r in ratios if r > 0]
    return {"modules": len(modules), "with_ratio": len(ratios),
            "geomean_rel_rms_ratio": math.exp(sum(map(math.log, positive)) / len(positive)) if positive else None,
            "min_rel_rms_ratio": min(ratios, default=None), "max_rel_rms_ratio": max(ratios, default=None),
            "b_lower": sum(r < 1 for r in ratios), "b_higher": sum(r > 1 for r in ratios),
            "equal": sum(r == 1 for r in ratios)}


def _r(x: Any) -> str:
    return "-" if x is None else f"{x:.4g}"


def markdown(cmp: dict[str, Any]) -> str:
    a, b, s = cmp["a"], cmp["b"], cmp["summary"]
    lines = ["# Quantization reports compared: B / A", "",
             f"- A: `{a['path']}` (recipe `{a['recipe']}`, report v{a['version']})",
             f"- B: `{b['path']}` (recipe `{b['recipe']}`, report v{b['version']})",
             f"- checkpoint: `{a['checkpoint']}`" + ("" if a["checkpoint"] == b["checkpoint"] else
                                                     f" (A) and `{b['checkpoint']}` (B)"), "",
             f"**Weight error** (relative RMS, B / A) over {s['with_ratio']} of {s['modules']} modules: geometric mean "
             f"{_r(s['geomean_rel_rms_ratio'])}, min {_r(s['min_rel_rms_ratio'])}, max {_r(s['max_rel_rms_ratio'])}; "
             f"B lower on {s['b_lower']}, higher on {s['b_higher']}, equal on {s['equal']}.", ""]
    if cmp["final"]:
        f = cmp["final"]
        lines += ["## Final logits (held-out)", "", "| | A | B | B / A |", "|---|---|---|---|",
                  f"| KL(original \\|\\| quantized), nats/token | {_num(f['kl']['a'], '.4g')} | {_num(f['kl']['b'], '.4g')} | "
                  f"{_r(f['kl']['ratio'])} |",
                  f"| top-1 agreement | {_pct(f['top1_agreement']['a'])} | {_pct(f['top1_agreement']['b'])} | "
                  f"{_r(f['top1_agreement']['ratio'])} |",
                  f"| tokens | {f['tokens']['a']} | {f['tokens']['b']} | |", ""]
    if cmp["layers"]:
        lines += ["## Hidden-state error by decoder layer (held-out)", "",
                  "| layer | name | A rel. RMS | B rel. RMS | B / A |", "|---|---|---|---|---|"]
        lines += [f"| {r['index']} | `{r['name']}` | {_num(r['a'], '.4g')} | {_num(r['b'], '.4g')} | {_r(r['ratio'])} |"
                  for r in cmp["layers"]]
        lines.append("")
    lines += ["## Weight error per quantized module", "",
              "Relative RMS of the dequantized export vs the source weight (routed experts: all experts together); "
              "scales by: the weight algorithm each run recorded. B / A is `-` where A's error is 0 (exact).", "",
              "| module | A scales by | B scales by | A rel. RMS | B rel. RMS | B / A | A max abs err | B max abs err |",
              "|---|---|---|---|---|---|---|---|"]
    for m in cmp["modules"]:
        lines.append(f"| `{m['name']}` | {weight_algorithm_text(m['a'])} | {weight_algorithm_text(m['b'])} | {_num(m['a']['rel_rms'], '.4g')} | "
                     f"{_num(m['b']['rel_rms'], '.4g')} | {_r(m['rel_rms_ratio'])} | {_num(m['a']['max_abs_err'])} | "
                     f"{_num(m['b']['max_abs_err'])} |")
    lines.append("")
    if cmp["not_compared"]:
        lines += ["Not compared:", ""] + [f"- {n}" for n in cmp["not_compared"]] + [""]
    return "\n".join(lines)


def plot(cmp: dict[str, Any], path: Path | IO[bytes]) -> None:
    """Left: weight error B / A per module (sorted); right: hidden-state error by layer, A and B."""
    rows = sorted((m for m in cmp["modules"] if m["rel_rms_ratio"] is not None), key=lambda m: m["rel_rms_ratio"])
    plt, fig = _figure(13, max(4.0, 0.22 * len(rows) + 1.5))
    ax = fig.add_subplot(1, 2, 1)
    values = [m["rel_rms_ratio"] for m in rows]
    ax.barh(range(len(rows)), values, color=["C2" if v < 1 else "C3" if v > 1 else "C7" for v in values])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([m["name"].replace("language_model.model.", "") for m in rows], fontsize=6)
    ax.set_xlabel("weight relative RMS error, B / A (green: B lower)")
    ax.set_title("Weight error ratio per module")
    ax.grid(axis="x", alpha=0.3)
    ax = fig.add_subplot(1, 2, 2)
    if cmp["layers"]:
        idx = [r["index"] for r in cmp["layers"]]
        ax.plot(idx, [r["a"] or 0.0 for r in cmp["layers"]], "o-", color="C0", label=f"A ({cmp['a']['recipe']})")
        ax.plot(idx, [r["b"] or 0.0 for r in cmp["layers"]], "s-", color="C1", label=f"B ({cmp['b']['recipe']})")
        ax.legend(loc="best")
        ax.xaxis.get_major_locator().set_params(integer=True)
    else:
        ax.text(0.5, 0.5, "no held-out pass in both", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("hidden-state relative RMS error (held-out)")
    ax.set_title("Hidden-state error by decoder layer")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


def compare_files(cmp: dict[str, Any]) -> dict[str, bytes]:
    """``compare.md``, ``compare.json`` and ``compare.png`` by name, as bytes (``paths.write_owned`` writes them)."""
    import json

    buf = io.BytesIO()
    plot(cmp, buf)
    return {"compare.md": markdown(cmp).encode(),
            "compare.json": (json.dumps(cmp, indent=1, sort_keys=True, allow_nan=False) + "\n").encode(),
            "compare.png": buf.getvalue()}


__all__ = ["COMPARE_FILES", "SCHEMA", "VERSION", "CompareError", "compare", "compare_files", "markdown", "plot",
           "ratio"]
