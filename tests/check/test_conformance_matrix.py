"""``modelopt-k3-check`` against what vLLM's and SGLang's own loaders did with the same exports.

``tests/data/engine_conformance.json`` is written by ``python -m tools.conformance`` (opt-in:
it installs the engines; see docs/ENGINE_CONFORMANCE.md). These tests need no engine: they recompute
the check's verdict for every cell and compare it with the engines' recorded verdict. A cell where the
check and the engine disagree must be one the committed file records as disagreeing (and the report
lists); a new disagreement, or a recorded one that no longer holds, fails until the matrix is re-run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelopt_k3.check import check_export, check_layout, kv_scale_names, planned_layout
from tools.conformance import matrix

MATRIX = Path(__file__).parents[1] / "data" / "engine_conformance.json"
DOC = json.loads(MATRIX.read_text())
ENGINES = tuple(DOC["engines"])


def _observed(row: dict, engine: str) -> str | None:
    return row["observed"].get(engine, {}).get("verdict")


def _disagreements(rows: list[dict], verdict_of) -> tuple[set, list[str]]:
    out, lines = set(), []
    for row in rows:
        for engine in ENGINES:
            seen = _observed(row, engine)
            if seen is None:
                continue  # the engine's run did not get far enough to say (recorded in the report)
            now = verdict_of(row, engine)
            if now != seen:
                out.add((row["id"], engine))
                lines.append(f"{row['id']} / {engine}: check says {now!r}, {engine} {DOC['engines'][engine]} did {seen!r}")
    return out, lines


def _recorded(rows: list[dict]) -> set:
    return {(r["id"], e) for r in rows for e, agree in r["agree"].items() if agree is False}


def test_the_matrix_covers_what_the_issue_asks():
    ids = {r["id"] for r in DOC["cells"]}
    assert {f"preset-{p}" for p in ("nvfp4", "nvfp4_experts_only", "w4a16_nvfp4", "fp8")} <= ids
    assert {"convert-default", "convert-mirror", "wide-convert-default"} <= ids
    assert any(r["how"] == "broken" for r in DOC["cells"])
    # Issue 30: Qwen3-MoE's exports on its stand-in (mlp_only_layers, hidden 64) and on the all-MoE 128-wide one.
    assert {f"{t}-{k}" for t in ("qwen3", "qwen3-wide")
            for k in ("qformat-nvfp4", "recipe-nvfp4", "qformat-w4a16_nvfp4")} <= ids
    # Issue 30 / 32: GPT-OSS's calibrated and converter exports; DeepSeek-V3's block-FP8 stand-in, with and without
    # FP8 KV-cache scales.
    assert {"gpt_oss-qformat-nvfp4", "gpt_oss-convert-default", "deepseek_v3-qformat-nvfp4",
            "deepseek_v3-qformat-nvfp4-kv_fp8"} <= ids
    assert set(ENGINES) == {"vllm", "sglang"} and all(DOC["stubs"][e] for e in ENGINES)
    for row in DOC["cells"]:
        for engine in ENGINES:
            r = row["observed"][engine]
            assert r.get("verdict") or r.get("outcome"), (row["id"], engine)


@pytest.fixture(scope="module")
def tiny_sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("conformance")
    return {v: matrix.tiny_checkpoint(root, v) for v in matrix.TINY_VARIANTS}


def test_the_up_front_check_of_each_recipe_cell_agrees_with_the_engines_as_recorded(tiny_sources):
    """Names and headers only (``--target_engines``' check): the structural verdict of each recipe cell."""
    rows = [r for r in DOC["cells"] if r["how"] != "broken"]
    verdicts = {}
    for row in rows:
        src = tiny_sources[row["tiny"]]
        layout = planned_layout(src, matrix.cell_recipe(matrix.CELL_BY_ID[row["id"]]),  # as check_recipe_for_engines
                                kv_scale_names=kv_scale_names(json.loads((src / "config.json").read_text())))
        verdicts[row["id"]] = {e: r.verdict for e, r in check_layout(layout, ENGINES, numerics=False).results.items()}
    found, lines = _disagreements(rows, lambda row, e: verdicts[row["id"]][e])
    print("\n".join(["check vs engine disagreements (up front):", *lines]))
    assert found == _recorded(rows), "\n".join(lines)


@pytest.mark.slow  # builds every cell's export (five calibrated hf_ptq runs) and checks it
def test_the_check_of_each_cell_export_agrees_with_the_engines_as_recorded(tmp_path: Path, restore_remote_code):
    built: dict[str, Path] = {}
    verdicts, stale = {}, []
    for cell in matrix.CELLS:
        export = matrix.build_export(cell, tmp_path, built)
        verdicts[cell.id] = {e: r.verdict for e, r in check_export(export, (*ENGINES, "trtllm")).results.items()}
    rows = [r for r in DOC["cells"] if r["id"] in verdicts]
    assert {r["id"] for r in rows} == set(verdicts), "matrix.CELLS and the committed matrix list other cells"
    for row in rows:
        for engine, v in verdicts[row["id"]].items():
            if row["check"][engine]["verdict"] != v:
                stale.append(f"{row['id']} / {engine}: recorded check {row['check'][engine]['verdict']!r}, now {v!r}")
    found, lines = _disagreements(rows, lambda row, e: verdicts[row["id"]][e])
    print("\n".join(["check vs engine disagreements:", *lines]))
    assert found == _recorded(rows), "\n".join(lines)
    assert not stale, "the check changed since the matrix was run; re-run it:\n" + "\n".join(stale)
