"""``report.md`` and the PNG plots, from the report's data alone (``modelopt-k3-report`` re-renders them).

matplotlib with the Agg backend (files only, no display); imported here and nowhere else.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import IO, Any

WORST = 20  # modules in the worst-modules plot and table
PLOTS = ("error_by_layer.png", "expert_tokens.png", "worst_modules.png")
_LAYER = re.compile(r"layers\.(\d+)\.")


def _num(x: Any, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.3g}%"


def weight_algorithm_text(m: dict[str, Any]) -> str:
    """A module's ``weight_algorithm`` for a table ("-" in version 1 reports, which have none)."""
    algo = m.get("weight_algorithm")
    if algo is None:
        return "-"
    return "lossless cast" if algo == "lossless_cast" else str(algo)


def _layer_index(name: str) -> int | None:
    m = _LAYER.search(name + ".")
    return int(m.group(1)) if m else None


def ranked_modules(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Quantized modules (dense, and each experts projection taken together), worst weight error first."""
    rows = [m for m in data["modules"] + data["experts"] if m.get("weight")]
    return sorted(rows, key=lambda m: (-(m["weight"]["rel_rms"] or 0.0), m["name"]))


def markdown(data: dict[str, Any]) -> str:
    run, final, cov = data["run"], data.get("final"), data["coverage"]
    lines = [f"# Quantization report: {run.get('checkpoint', '')}", "",
             f"Recipe `{run.get('recipe')}`; {run.get('world_size')} rank(s) ({run.get('plan')}); schema "
             f"{data['schema']} v{data['version']}.", ""]
    if final:
        lines += [f"**Final logits** on {final['tokens']} held-out tokens ({run.get('held_out_sequences')} sequences): "
                  f"KL(original || quantized) = {_num(final['kl'], '.4g')} nats/token, top-1 agreement "
                  f"{_pct(final['top1_agreement'])}.", ""]
    starved = [(layer["module"], u["expert"]) for layer in cov["layers"] for u in layer["uncovered"]]
    lines += [f"**Expert coverage**: {len(starved)} expert(s) below {cov['min_expert_tokens']} calibration token(s) "
              f"(policy `{cov['policy']}`)." if cov["counted"] else
              "**Expert coverage**: not counted (no calibration forward ran for the experts: none of their "
              "scales depends on calibration).", ""]
    if data["layers"]:
        lines += ["## Hidden-state error by decoder layer", "",
                  "Relative RMS of (quantized - original) hidden state at each decoder layer's output, held-out data "
                  "(the error accumulated up to that layer).", "", "| layer | name | rel. RMS |", "|---|---|---|"]
        lines += [f"| {r['index']} | `{r['name']}` | {_num(r['hidden_rel_rms'], '.4g')} |" for r in data["layers"]]
        lines.append("")
    lines += ["## Quantized modules (worst weight error first)", "",
              "Weight error: the dequantized export vs the source weight. Units are NVFP4 blocks of 16 "
              "(elements for FP8); saturated: block scale above 448 (values clip); underflow: non-zero "
              "block whose scale falls below 2^-9. Scales by: the weight algorithm that produced the scales, as the "
              "run's calibrator recorded it.", "",
              "| module | algo | scales by | rel. RMS | max abs err | max err / amax | saturated | underflow | weight scale | "
              "input scale | input clip (calib / held-out) | held-out block underflow | MXFP4 blocks lossless / requantized |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in ranked_modules(data):
        w, i = m["weight"], m.get("input") or {}
        wscale = m.get("weight_scale")
        if isinstance(wscale, list):
            wscale = None
        src = (f"{m['lossless_blocks']} / {m['requantized_blocks']}" if m.get("source") == "mxfp4" else "-")
        lines.append(
            f"| `{m['name']}` | {m['algo']} | {weight_algorithm_text(m)} | {_num(w['rel_rms'], '.4g')} | {_num(w['max_abs_err'])} | "
            f"{_num(w['rel_max_err'])} | {_pct(w['saturated_fraction'])} | {_pct(w['underflow_fraction'])} | "
            f"{_num(wscale)} | {_num(i.get('scale'))}{' (const)' if i.get('constant') else ''} | "
            f"{_pct(i.get('calibration_clip_fraction'))} / {_pct(i.get('held_out_clip_fraction'))} | "
            f"{_pct(i.get('held_out_block_underflow_fraction'))} | {src} |")
    lines.append("")
    if cov["counted"]:
        lines += ["## Expert coverage (calibration tokens per MoE layer)", "",
                  "| MoE layer | tokens min / median / max | experts below threshold | input scales depend on calibration |",
                  "|---|---|---|---|"]
        for layer in cov["layers"]:
            handled = sorted(layer["handled"])
            ids = [u["expert"] for u in layer["uncovered"]]
            lines.append(f"| `{layer['module']}` | {handled[0]} / {handled[len(handled) // 2]} / {handled[-1]} | "
                         f"{ids or '-'} | {'yes' if layer['depends_on_calibration'] else 'no'} |")
        lines.append("")
        dependence = cov["layers"][0]["scale_dependence"] if cov["layers"] else {}
        if dependence:
            lines += ["Which expert scales depend on calibration (first MoE layer; the others are alike):", ""]
            lines += [f"- `{param}`: weight scales: {d['weight']}; input scale: {d['input']}."
                      for param, d in sorted(dependence.items())]
            lines.append("")
        for layer in cov["layers"]:
            for u in layer["uncovered"]:
                lines.append(f"- `{layer['module']}` expert {u['expert']} ({u['routed']} routed, {u['handled']} "
                             f"calibrated on):")
                lines += [f"  - `{param}`: input_scale {_num(s['input_scale'], '.4g')}: {s['why']}"
                          for param, s in sorted(u["scales"].items())]
        lines.append("")
    lines += ["## Plots", ""] + [f"![{p}]({p})" for p in PLOTS] + [""]
    return "\n".join(lines)


def _figure(*size):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, plt.figure(figsize=size)


def plot_error_by_layer(data: dict[str, Any], path: Path | IO[bytes]) -> None:
    plt, fig = _figure(8, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    if data["layers"]:
        idx = [r["index"] for r in data["layers"]]
        ax.plot(idx, [r["hidden_rel_rms"] or 0.0 for r in data["layers"]], "o-", color="C0",
                label="hidden state at layer output (held-out)")
    worst: dict[int, float] = {}
    for m in data["modules"] + data["experts"]:
        i = _layer_index(m["name"])
        if i is not None and m.get("weight"):
            worst[i] = max(worst.get(i, 0.0), m["weight"]["rel_rms"] or 0.0)
    if worst:
        ax.bar(sorted(worst), [worst[i] for i in sorted(worst)], color="C1", alpha=0.5,
               label="worst weight of the layer")
    ax.set_xlabel("decoder layer")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("relative RMS error")
    ax.set_title("Quantization error by decoder layer")
    ax.legend(loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


def plot_expert_tokens(data: dict[str, Any], path: Path | IO[bytes]) -> None:
    import numpy as np

    layers = data["coverage"]["layers"]
    plt, fig = _figure(9, max(3.0, 0.35 * len(layers) + 2))
    ax = fig.add_subplot(1, 1, 1)
    if layers:
        counts = np.array([layer["handled"] for layer in layers], dtype=float)
        img = ax.imshow(np.log10(counts + 1), aspect="auto", cmap="viridis", interpolation="nearest")
        fig.colorbar(img, ax=ax, label="log10(tokens + 1)")
        starved = [(e, r) for r, layer in enumerate(layers) for e in (u["expert"] for u in layer["uncovered"])]
        if starved:
            ax.scatter([e for e, _ in starved], [r for _, r in starved], marker="x", color="red", s=60,
                       label=f"below {data['coverage']['min_expert_tokens']} token(s)")
            ax.legend(loc="upper right")
        ax.set_yticks(range(len(layers)))
        ax.set_yticklabels([str(_layer_index(layer["module"] + ".")) for layer in layers])
    else:
        ax.text(0.5, 0.5, "tokens not counted", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE decoder layer")
    ax.set_title("Calibration tokens per expert (layers x experts)")
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


def plot_worst_modules(data: dict[str, Any], path: Path | IO[bytes]) -> None:
    worst = ranked_modules(data)[:WORST][::-1]
    plt, fig = _figure(9, max(3.0, 0.3 * len(worst) + 1.5))
    ax = fig.add_subplot(1, 1, 1)
    colors = ["C2" if m["kind"] == "experts" else "C0" for m in worst]
    values = [m["weight"]["rel_rms"] or 0.0 for m in worst]
    ax.barh(range(len(worst)), values, color=colors)
    for y, (v, m) in enumerate(zip(values, worst)):
        lossless = m.get("source") == "mxfp4" and not m.get("requantized_blocks")
        ax.text(v, y, f" {v:.3g}" + (" (lossless MXFP4 cast)" if lossless else ""), va="center", fontsize=7)
    ax.set_yticks(range(len(worst)))
    ax.set_yticklabels([m["name"].replace("language_model.model.", "") for m in worst], fontsize=7)
    ax.set_xlabel("weight relative RMS error (green: routed experts, all experts together)")
    ax.set_title(f"Worst {len(worst)} quantized modules by weight error")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


def render_files(data: dict[str, Any]) -> dict[str, bytes]:
    """``report.md`` and the plots, by file name, as bytes (written by ``render`` / ``write_report``)."""
    files = {"report.md": markdown(data).encode()}
    for name, plot in zip(PLOTS, (plot_error_by_layer, plot_expert_tokens, plot_worst_modules)):
        buf = io.BytesIO()
        plot(data, buf)
        files[name] = buf.getvalue()
    return files


def render(data: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write ``report.md`` and the plots into ``out_dir`` (``paths.write_owned``: never through a link, never over
    a file we did not write, never into a checkpoint); returns the files written."""
    from ..files.paths import write_owned

    return write_owned(Path(out_dir), render_files(data), flag="the report directory")
