"""The README's Kimi-K3 serving table says what ``modelopt-k3-check`` says: each row's recipe planned on the
128-wide tiny Kimi-K3 (the mirror row, which is about Kimi-K3's full dimensions, is not checked here: planning the full-size layout took over 10 min) and checked up
front, each engine's cell read back as a verdict. A rule that changes a verdict turns this red until the README
row is updated."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from modelopt_k3.check import check_layout, kv_scale_names, planned_layout
from modelopt_k3.recipe import load_recipe
from tools.conformance import matrix

README = Path(__file__).resolve().parents[2] / "README.md"
HEADER = "| recipe | vLLM 0.33.0 | SGLang 0.5.23 | TensorRT-LLM (newest K3 loader read) |"
ENGINES = ("vllm", "sglang", "trtllm")
# The table's short names: hf_ptq's --qformat presets (Kimi-K3 maps none of them to a recipe of its own).
SHORT = {"nvfp4": "presets/nvfp4", "nvfp4_experts_only": "presets/nvfp4_experts_only", "trtllm": "presets/trtllm",
         "w4a16_nvfp4": "presets/w4a16_nvfp4", "fp8": "presets/fp8"}
MIRROR = "models/moonshotai/Kimi-K3/nvfp4_experts-fp8_pb_attention"


def _rows() -> list[tuple[list[str], list[str]]]:
    """(recipe names, the three engine cells) of each row of the table."""
    lines = README.read_text().splitlines()
    start = lines.index(HEADER) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        first, *cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((re.findall(r"`([^`]+)`", first.split("(")[0]), cells))
    return rows


def _said(cell: str, before: str | None) -> str:
    """The verdict a README cell states."""
    text = cell.lower()
    if text == "same":
        assert before is not None
        return before
    if text.startswith(("yes", "on kimi-k3's dimensions")):
        return "loads correctly"
    if text.startswith(("serves different numbers", "scales ignored")):
        return "loads but serves different numbers"
    assert text.startswith("no"), cell
    return "refuses"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("readme")
    return {"wide": matrix.tiny_checkpoint(root, "wide")}


def _verdicts(src: Path, recipe_name: str, kv_cache: bool) -> dict[str, str]:
    recipe = load_recipe(recipe_name, overrides={"kv_cache": "fp8"} if kv_cache else None)
    names = kv_scale_names(json.loads((src / "config.json").read_text())) if kv_cache else ()
    layout = planned_layout(src, recipe, kv_scale_names=names)
    return {e: r.verdict for e, r in check_layout(layout, ENGINES, numerics=False).results.items()}


def test_every_row_but_the_mirror_says_what_the_check_says_on_the_wide_tiny_model(sources) -> None:
    rows = _rows()
    assert len(rows) >= 6
    checked = 0
    for names, cells in rows:
        kv_cache = names == ["kv_cache: fp8"]  # "any recipe with it": the converter default with the override
        recipes = ["models/moonshotai/Kimi-K3/nvfp4_experts"] if kv_cache else [SHORT.get(n, n) for n in names]
        if MIRROR in recipes:
            continue
        said, before = [], None
        for cell in cells:
            before = _said(cell, before)
            said.append(before)
        for recipe in recipes:
            got = _verdicts(sources["wide"], recipe, kv_cache)
            assert [got[e] for e in ENGINES] == said, (recipe, got, cells)
            checked += 1
    assert checked >= 6

