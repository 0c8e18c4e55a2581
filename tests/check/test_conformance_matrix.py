"""``modelopt-k3-check`` against what vLLM's and SGLang's own loaders did with the same exports, and against what
TensorRT-LLM's own Kimi-K3 resolution functions answered for them (``trtllm_replay``, written by
``python -m tools.conformance.trtllm``, which runs those functions from a TensorRT-LLM source tree).

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
from modelopt_k3.check.layout import scan_export
from tools.conformance import matrix, trtllm

MATRIX = Path(__file__).parents[1] / "data" / "engine_conformance.json"
DOC = json.loads(MATRIX.read_text())
ENGINES = tuple(DOC["engines"])
REPLAY = DOC.get("trtllm_replay") or {"cells": [], "sources": [], "stubs": []}


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
    # Issue 40: the five new models' --qformat nvfp4 exports (and the variants their stand-ins need to get past the
    # engines' CPU-visible rules); issue 43: AWQ and AWQ+GPTQ beside max on both Qwen3-MoE stand-ins.
    assert {"kimi_k25-qformat-nvfp4", "minimax_m2-qformat-nvfp4", "glm_moe_dsa-qformat-nvfp4",
            "glm_moe_dsa-qformat-nvfp4-release_config", "qwen3_5_moe-qformat-nvfp4",
            "qwen3_5_moe-qformat-nvfp4-release_config", "nemotron_h-qformat-nvfp4",
            "nemotron_h-wide-qformat-nvfp4", "nemotron_h-wide-g2-qformat-nvfp4",
            "nemotron_h-wide-g2-qformat-nvfp4-mamba_n_groups"} <= ids
    assert {f"{t}-recipe-nvfp4_default_{a}" for t in ("qwen3", "qwen3-wide") for a in ("awq", "awq_gptq")} <= ids
    assert set(ENGINES) == {"vllm", "sglang"} and all(DOC["stubs"][e] for e in ENGINES)
    for row in DOC["cells"]:
        for engine in ENGINES:
            r = row["observed"][engine]
            assert r.get("verdict") or r.get("outcome"), (row["id"], engine)


@pytest.fixture(scope="module")
def tiny_sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("conformance")
    return {v: matrix.tiny_checkpoint(root, v) for v in matrix.TINY_VARIANTS}


def test_awq_exports_load_wherever_max_does():
    """Issue 43: on each Qwen3-MoE stand-in, the AWQ and AWQ+GPTQ exports got, from each engine's own loader, the
    verdict the max export (``<tiny>-qformat-nvfp4``, presets/nvfp4_default) got -- and "loads correctly" wherever
    max does (vLLM on both, SGLang on the 128-wide one)."""
    rows = {r["id"]: r for r in DOC["cells"]}
    for tiny in ("qwen3", "qwen3-wide"):
        for engine in ENGINES:
            want = _observed(rows[f"{tiny}-qformat-nvfp4"], engine)
            for algo in ("awq", "awq_gptq"):
                assert _observed(rows[f"{tiny}-recipe-nvfp4_default_{algo}"], engine) == want, (tiny, algo, engine)
    assert {_observed(rows["qwen3-wide-recipe-nvfp4_default_awq"], e) for e in ENGINES} == {"loads correctly"}


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


# --------------------------------------------------------------------------- TensorRT-LLM's functions, replayed


def _replay_disagreements(rows: list[dict], layout_of) -> list[str]:
    """Calls where the check's TensorRT-LLM rules now answer otherwise than TensorRT-LLM's functions did."""
    lines = []
    for row in rows:
        keys = list(row["calls"])
        layout = layout_of(row)
        for key, mine in zip(keys, trtllm.check_calls(layout, trtllm.calls_of(keys))):
            if not trtllm.agree(row["calls"][key], trtllm.answer(mine)):
                lines.append(f"{row['id']} / {key}: TensorRT-LLM {row['calls'][key][:120]!r}, "
                             f"check {trtllm.answer(mine)[:120]!r}")
    return lines


def test_the_trtllm_replay_covers_the_kimi_k3_cells_and_the_manifest_edits():
    ids = [r["id"] for r in REPLAY["cells"]]
    assert ids == [c.id for c in trtllm.REPLAY_CELLS], "re-run python -m tools.conformance.trtllm --update_committed"
    assert {"manifest-attn-alias-conflict", "manifest-kda-fp8-partial", "manifest-bank-excluded"} <= set(ids)
    assert [s["file"] for s in REPLAY["sources"]] == list(trtllm.PINNED)
    assert REPLAY["stubs"] and all(s["name"] and s["why"] for s in REPLAY["stubs"])
    assert not [d for r in REPLAY["cells"] for d in r["disagreements"]], "the committed replay records disagreements"
    for row in REPLAY["cells"]:
        assert row["calls"] and row["replay"]["outcome"] in ("raises", "resolves"), row["id"]
        if row["replay"]["outcome"] == "raises":  # TensorRT-LLM raised building the model: the check refuses
            assert row["check"]["verdict"] == "refuses", row["id"]


def test_the_up_front_check_resolves_each_recipe_cell_as_trtllm_did(tiny_sources):
    """Names and headers only: each resolution call of each recipe cell, as TensorRT-LLM's functions answered."""
    rows = [r for r in REPLAY["cells"] if r["how"] != "broken"]
    lines = _replay_disagreements(
        rows, lambda row: planned_layout(tiny_sources[row["tiny"]], matrix.recipe_of(row["recipe"])))
    assert not lines, "\n".join(lines)


@pytest.mark.slow  # builds every replayed cell's export (five calibrated hf_ptq runs)
def test_the_check_of_each_replayed_export_resolves_as_trtllm_did(tmp_path: Path, restore_remote_code):
    built: dict[str, Path] = {}
    rows = {r["id"]: r for r in REPLAY["cells"]}
    lines, stale = [], []
    for cell in trtllm.REPLAY_CELLS:
        export = matrix.build_export(cell, tmp_path, built)
        layout, reader = scan_export(export)
        with reader:
            lines += _replay_disagreements([rows[cell.id]], lambda row, layout=layout: layout)
        now = check_export(export, ("trtllm",)).results["trtllm"].verdict
        if now != rows[cell.id]["check"]["verdict"]:
            stale.append(f"{cell.id}: recorded check {rows[cell.id]['check']['verdict']!r}, now {now!r}")
    assert not lines, "\n".join(lines)
    assert not stale, "the check changed since the replay was run; re-run it:\n" + "\n".join(stale)
