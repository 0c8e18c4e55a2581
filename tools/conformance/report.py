"""The committed matrix (JSON, compared by the CI test) and its human-readable report (Markdown)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from modelopt_k3.files.paths import replace_file, write_owned

from .drivers.stub_list import STUBS
from .verdict import cpu_limit

SCHEMA = 1


def agreement(row: dict, engine: str) -> bool | None:
    """Whether the check's verdict equals the engine's observed one (None: the engine's was not observed)."""
    seen = row["observed"].get(engine, {}).get("verdict")
    return None if seen is None else seen == row["check"][engine]["verdict"]


def _trim(result: dict) -> dict:
    """What the committed JSON keeps of a driver's result (the per-tensor landing map stays out: it is
    long; the count, the misses and the never-written parameters stay)."""
    keep = {k: v for k, v in result.items() if k not in ("load", "seconds", "error")}
    if "error" in result:
        keep["error"] = {k: result["error"][k] for k in ("stage", "type", "message", "where")}
    if "load" in result:
        load = result["load"]
        keep["load"] = {k: load[k] for k in ("tensors", "landed_byte_equal", "landed_lossless_other_form",
                                             "landed_rounded", "not_landed", "not_landed_by_design",
                                             "params_never_written", "engine_owned_never_written")
                        if load.get(k) or k in ("not_landed", "params_never_written")}
    if "post_load" in result:
        post = dict(result["post_load"])
        post["mismatches"] = post.get("mismatches", [])[:5]
        keep["post_load"] = post
    for key in ("first_forward", "other_backends"):
        if result.get(key):
            keep[key] = _strip_tracebacks(result[key])
    return keep


def _strip_tracebacks(value):
    if isinstance(value, dict):
        return {k: _strip_tracebacks(v) for k, v in value.items() if k != "traceback"}
    return value


ENGINE_SECTIONS = ("## Verdicts: check vs engine", "## Cells", "## Stubs (the GPU-only pieces replaced on CPU)")
REPLAY_SECTION = "## TensorRT-LLM replay (its own resolution functions)"  # only with a trtllm_replay (trtllm.py)
GENERATED_SECTIONS = (*ENGINE_SECTIONS, REPLAY_SECTION)


def _sorted_cells(cells: list[dict], order: list[str]) -> list[dict]:
    """The matrix's own cell order (``matrix.CELLS``), cells it no longer lists after them by id."""
    rank = {cell_id: i for i, cell_id in enumerate(order)}
    return sorted(cells, key=lambda r: (rank.get(r["id"], len(rank)), r["id"]))


def merge_rows(old: dict, fresh: dict, order: list[str]) -> dict:
    """``old`` (a written matrix) with ``fresh``'s cells and engine versions replacing its own."""
    rows = {r["id"]: r for r in old["cells"]}
    rows.update({r["id"]: r for r in fresh["cells"]})
    merged = {"engines": {**old["engines"], **fresh["engines"]}, "cells": _sorted_cells(list(rows.values()), order)}
    if "trtllm_replay" in old or "trtllm_replay" in fresh:  # written by tools.conformance.trtllm, carried over
        merged["trtllm_replay"] = fresh.get("trtllm_replay", old.get("trtllm_replay"))
    return merged


def write_report(result: dict, json_path: Path, md_path: Path, *, order: list[str],
                 keep_sections_of: Path | None = None, generated: str | None = None,
                 owned_flag: str | None = None) -> dict:
    """Write the matrix (JSON) and its report (Markdown); returns the written matrix. Rows follow ``order``,
    engines their names; ``owned_flag``: the two files go into a results directory of the tool's own
    (``files.paths.write_owned``: never through a link, never over a file it did not write), else each
    file is replaced as a file of the repository; ``keep_sections_of``: a report whose sections other than the generated ones
    (findings, how to run, before/after tables) are carried over, in their order."""
    cells = []
    for row in _sorted_cells(result["cells"], order):
        row = dict(row)
        row["observed"] = {e: _trim(r) for e, r in sorted(row["observed"].items())}
        for r in row["observed"].values():
            if r.get("error") and cpu_limit(r["error"]):
                note = f"{r['error']['stage']} (needs a GPU here)"
                if note not in r.setdefault("not_observable", []):
                    r["not_observable"].insert(0, note)
        row["agree"] = {e: agreement(row, e) for e in row["observed"]}
        cells.append(row)
    engines = dict(sorted(result["engines"].items()))
    doc = {"schema": SCHEMA, "generated": generated or datetime.date.today().isoformat(), "engines": engines,
           "stubs": {e: [{"name": n, "why": w} for n, w in STUBS[e]] for e in engines},
           "cells": cells}
    if result.get("trtllm_replay"):  # tools.conformance.trtllm's rows: carried as written
        doc["trtllm_replay"] = result["trtllm_replay"]
    kept = kept_sections(keep_sections_of.read_text()) if keep_sections_of and keep_sections_of.exists() else []
    files = {json_path: (json.dumps(doc, indent=1, sort_keys=False) + "\n").encode(),
             md_path: (markdown(doc).rstrip("\n") + "".join(f"\n\n{section}" for section in kept) + "\n").encode()}
    if owned_flag is not None and json_path.parent == md_path.parent:  # a directory of results the tool owns
        write_owned(json_path.parent, {p.name: data for p, data in files.items()}, flag=owned_flag)
    else:  # the committed matrix and report: files of the repository, replaced, never written through
        for path, data in files.items():
            replace_file(path, data, flag="conformance")
    return doc


def kept_sections(text: str) -> list[str]:
    """The ``## `` sections of a report that ``markdown`` does not generate, each with its body."""
    sections: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("## "):
            sections.append([line])
        elif sections:
            sections[-1].append(line)
    return ["\n".join(s).strip("\n") for s in sections if s[0] not in GENERATED_SECTIONS]


def _cell_text(row: dict, engine: str) -> str:
    r = row["observed"].get(engine)
    if r is None:
        return "not run"
    verdict = r.get("verdict") or r.get("outcome", "?")
    parts = [f"**{verdict}**"]
    if r.get("moe_runner_backend_resolved"):
        parts.append(f"MoE runner the engine resolved: `{r['moe_runner_backend_resolved']}`")
    if "error" in r:
        e = r["error"]
        parts.append(f"at {e['stage']}: `{e['type']}: {e['message'][:160]}`")
    if "load" in r:
        load = r["load"]
        parts.append(f"{load['landed_byte_equal']}/{load['tensors']} tensors byte-equal")
        if load.get("landed_lossless_other_form"):
            parts.append(f"{len(load['landed_lossless_other_form'])} landed losslessly in another form "
                         "(zero-padded, another float dtype or a prefix)")
        if load["not_landed"]:
            parts.append(f"not landed: {', '.join('`' + n + '`' for n in load['not_landed'][:3])}"
                         + (" ..." if len(load["not_landed"]) > 3 else ""))
        if load.get("not_landed_by_design"):
            whys = sorted(set(load["not_landed_by_design"].values()))
            parts.append(f"{len(load['not_landed_by_design'])} skipped or transformed by the class on purpose "
                         f"({'; '.join(whys)[:200]})")
        if load["params_never_written"]:
            names = list(load["params_never_written"])
            parts.append(f"never written: {', '.join('`' + n + '`' for n in names[:3])}" + (" ..." if len(names) > 3 else ""))
    if "load" in r and r["load"].get("landed_rounded"):
        worst = max(v["max_rel"] for v in r["load"]["landed_rounded"].values())
        parts.append(f"{len(r['load']['landed_rounded'])} source-F32 tensors rounded to the engine's dtype "
                     f"(max rel {worst:.2g}; the source checkpoint reads the same way)")
    post = r.get("post_load")
    if post:
        if post.get("compared"):
            parts.append(f"post-load scales: {post['compared']} compared, max rel err {post['max_rel']:.2g}")
        for m in post.get("mismatches", [])[:2]:
            parts.append(f"`{m['param']}` rel err {m['rel']:.3g}")
    ff = r.get("first_forward")
    if ff:
        err = ff.get("error") or {}
        parts.append(f"first forward of `{ff.get('layer')}` (routed experts): {ff.get('outcome')}"
                     + (f" (`{err.get('type')}: {err.get('message', '')[:100]}`)" if err else ""))
    for backend, o in (r.get("other_backends") or {}).items():
        ffo = o.get("first_forward") or {}
        err = ffo.get("error") or o.get("error") or {}
        parts.append(f"with --moe-runner-backend {backend}: {ffo.get('outcome') or o.get('outcome')}"
                     + (f" (`{err.get('type')}: {err.get('message', '')[:100]}`)" if err else ""))
    for note in r.get("not_observable", []):
        parts.append(f"not observable on CPU: {note}")
    for note in r.get("notes", []):
        parts.append(note)
    return "; ".join(parts)


def markdown(doc: dict) -> str:
    engines = sorted(doc["engines"])
    lines = [
        "# Engine-in-the-loop conformance",
        "",
        "Generated by `python -m tools.conformance` on "
        f"{doc['generated']} with " + ", ".join(f"{e} {v}" for e, v in doc["engines"].items())
        + " (PyPI wheels, CUDA builds, run on CPU). Each engine's own model class (the one for "
        "the export's model_type) was built from the export's configs and its own model loader ran `load_weights` and, where the CPU "
        "allows, "
        "`process_weights_after_loading` on the export. The matrix is `tests/data/engine_conformance.json`; "
        "`tests/check/test_conformance_matrix.py` compares `modelopt-k3-check`'s verdicts with it.",
        "",
        "Observed verdicts: **refuses** (the engine raised building the model, in `load_weights` or in "
        "post-processing), **loads but serves different numbers** (an export tensor landed in no engine "
        "parameter byte for byte, an engine parameter was never written, or a post-load scale differs "
        "from the export's), **loads correctly** (none of these).",
        "",
        "## Verdicts: check vs engine",
        "",
        "| cell | " + " | ".join(f"{e}: check / engine" for e in engines) + " | trtllm: check (no engine run) |",
        "|---|" + "---|" * (len(engines) + 1),
    ]
    disagree = []
    for row in doc["cells"]:
        cols = []
        for e in engines:
            seen = row["observed"].get(e, {}).get("verdict") or row["observed"].get(e, {}).get("outcome", "not run")
            mark = {True: "", False: " **DISAGREE**", None: " (not observed)"}[row["agree"].get(e)]
            cols.append(f"{row['check'][e]['verdict']} / {seen}{mark}")
            if row["agree"].get(e) is False:
                disagree.append((row["id"], e))
        lines.append(f"| `{row['id']}` | " + " | ".join(cols) + f" | {row['check']['trtllm']['verdict']} |")
    lines += ["", f"Disagreements: {len(disagree)}" + (": " + ", ".join(f"`{c}` ({e})" for c, e in disagree)
                                                        if disagree else "."), ""]
    lines += ["## Cells", ""]
    for row in doc["cells"]:
        lines += [f"### `{row['id']}`", "", f"{row['about']} (recipe `{row['recipe']}`, tiny `{row['tiny']}`).", ""]
        for e in engines:
            lines.append(f"- {e} {doc['engines'][e]}: {_cell_text(row, e)}")
            first = row["check"][e].get("first")
            lines.append(f"  - check: {row['check'][e]['verdict']}" + (f" ({first[:200]})" if first else ""))
        lines.append("")
    lines += ["## Stubs (the GPU-only pieces replaced on CPU)", ""]
    for e in engines:
        lines.append(f"{e}:")
        lines.append("")
        lines += [f"- `{s['name']}`: {s['why']}" for s in doc["stubs"][e]]
        lines.append("")
    if doc.get("trtllm_replay"):
        from .trtllm import markdown as trtllm_markdown

        lines += [trtllm_markdown(doc["trtllm_replay"]), ""]
    return "\n".join(lines)
