"""The docs' serving tables (docs/SERVING.md for Kimi-K3, docs/MODELS.md per model) say what ``modelopt-k3-check`` says on the exports they describe, each engine's cell
read back as a verdict (and, where it names a serve flag, the flag). A rule that changes a verdict turns this red
until the table's row is updated.

- Kimi-K3 (docs/SERVING.md): each row's recipe planned on the 128-wide tiny Kimi-K3 and checked up front (what
  ``--target_engines`` checks). The mirror row's "not on the tiny model" part is checked on both tiny Kimi-K3s; its
  "on Kimi-K3's dimensions" part is not: no ``matrix.TINY_VARIANTS`` Kimi-K3 has 128-multiple attention dims.
- Qwen3-MoE (docs/MODELS.md, "## Qwen3-MoE"): each row names its checkpoint, "Qwen3's sizes" (checked on the all-MoE 128-wide
  stand-in, ``qwen3-wide``) or "the tiny stand-in" (``qwen3``: ``mlp_only_layers``, hidden 64), planned and checked up
  front; the row that also names ``modelopt-k3-convert`` is checked again on the converter's own export.
- GPT-OSS (docs/MODELS.md, "## GPT-OSS"): the calibrated row planned up front; the converter row on the converter's export too
  (its quantized Linears and configs are the planned layout's, name for name; the converter takes under a second).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from modelopt_k3.check import check_export, check_layout, kv_scale_names, planned_layout
from modelopt_k3.convert import convert_checkpoint
from modelopt_k3.recipe import load_recipe
from modelopt_k3.run.plan import QFORMAT_PRESETS
from modelopt_k3.spec import get_spec
from tools.conformance import matrix

DOCS = [Path(__file__).resolve().parents[2] / "docs" / name for name in ("SERVING.md", "MODELS.md")]
KIMI_K3 = "| recipe | vLLM 0.33.0 | SGLang 0.5.23 | TensorRT-LLM (newest K3 loader read) |"
QWEN3_MOE = "| recipe (Qwen3-MoE) | checkpoint | vLLM 0.33.0 | SGLang 0.5.23 | TensorRT-LLM |"
GPT_OSS = "| recipe (GPT-OSS) | experts | attention | vLLM 0.33.0 | SGLang 0.5.23 | TensorRT-LLM |"
ENGINES = ("vllm", "sglang", "trtllm")  # the last three columns of every table
# The Kimi-K3 table's short names: hf_ptq's --qformat presets (Kimi-K3 maps none of them to a recipe of its own).
SHORT = {"nvfp4": "presets/nvfp4", "nvfp4_experts_only": "presets/nvfp4_experts_only", "trtllm": "presets/trtllm",
         "w4a16_nvfp4": "presets/w4a16_nvfp4", "fp8": "presets/fp8"}
MIRROR = matrix.MIRROR
# The Qwen3-MoE table's "checkpoint" column -> the tiny variant its verdicts are checked on.
QWEN3_CHECKPOINTS = {"Qwen3's sizes": "qwen3-wide", "the tiny stand-in": "qwen3"}


def _rows(header: str) -> list[tuple[str, list[str]]]:
    """(first cell, the other cells) of each row of the table under ``header``."""
    lines = next(lines for doc in DOCS for lines in [doc.read_text().splitlines()] if header in lines)
    start = lines.index(header) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        first, *cells = [c.strip() for c in line.strip().removeprefix("|").removesuffix("|").split("|")]
        rows.append((first, cells))
    return rows


def _names(first: str) -> list[str]:
    """The recipe names a row's first cell gives (before its parenthesis)."""
    return re.findall(r"`([^`]+)`", first.split("(")[0])


def _said(cells: list[str]) -> list[str]:
    """The verdicts the engine cells (the last three) state; "same": the cell before's."""
    said: list[str] = []
    for cell in cells[-len(ENGINES):]:
        text = cell.lower()
        if text == "same":
            said.append(said[-1])
        elif text.startswith("yes"):
            said.append("loads correctly")
        elif text.startswith(("serves different numbers", "scales ignored")):
            said.append("loads but serves different numbers")
        else:
            assert text.startswith("no"), cell
            said.append("refuses")
    return said


def _assert_says(cells: list[str], report, what) -> None:
    """The engine cells state ``report``'s verdicts; a "yes" cell names exactly the serve flags the check asks for."""
    got = [report.results[e].verdict for e in ENGINES]
    assert got == _said(cells), (what, dict(zip(ENGINES, got)), cells)
    for engine, cell in zip(ENGINES, cells[-len(ENGINES):]):
        if cell.lower().startswith("yes"):
            flags = [f.split(" (")[0] for f in report.results[engine].serve_flags]
            assert re.findall(r"`(--[^`]+)`", cell) == flags, (what, engine, flags, cell)


def _planned(src: Path, recipe_name: str, kv_cache: bool = False):
    """The up-front check (names and headers) of exporting ``src`` with ``recipe_name``."""
    recipe = load_recipe(recipe_name, overrides={"kv_cache": "fp8"} if kv_cache else None)
    names = kv_scale_names(json.loads((src / "config.json").read_text())) if kv_cache else ()
    return check_layout(planned_layout(src, recipe, kv_scale_names=names), ENGINES, numerics=False)


def _converted(root: Path, tiny: str, recipe_name: str):
    """``modelopt-k3-check`` on what the converter writes from the tiny ``tiny`` with ``recipe_name``."""
    dst = root / f"converted-{tiny}-{recipe_name.replace('/', '_')}"
    convert_checkpoint(matrix.tiny_checkpoint(root, tiny), dst, load_recipe(recipe_name), progress=False)
    return check_export(dst, ENGINES)


def _recipe(first: str, model_type: str) -> str:
    """The one recipe a row names, with the ``--qformat`` / ``--recipe`` / converter-default claims of its first cell
    checked against the model's spec (what ``hf_ptq`` and ``modelopt-k3-convert`` resolve)."""
    (name,) = _names(first)
    recipes = get_spec(model_type).recipes
    for qformat in re.findall(r"`--qformat (\S+?)`", first):
        assert recipes.qformat.get(qformat, QFORMAT_PRESETS[qformat]) == name, first
    for given in re.findall(r"--recipe (\S+?)`", first):
        assert load_recipe(given).name == name, first
    if "`modelopt-k3-convert`'s default" in first:
        assert recipes.converter == name, first
    return name


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("readme")
    for tiny in ("default", "wide", "qwen3", "qwen3-wide", "gpt_oss"):
        matrix.tiny_checkpoint(root, tiny)
    return root


def test_every_kimi_k3_row_but_the_mirror_says_what_the_check_says_on_the_wide_tiny_model(root) -> None:
    rows = _rows(KIMI_K3)
    assert len(rows) >= 6
    checked = 0
    for first, cells in rows:
        names = _names(first)
        kv_cache = names == ["kv_cache: fp8"]  # "any recipe with it": the converter default with the override
        recipes = [matrix.CONVERTER_DEFAULT] if kv_cache else [SHORT.get(n, n) for n in names]
        if MIRROR in recipes:  # on Kimi-K3's dimensions: no tiny variant has them (module docstring)
            continue
        for recipe in recipes:
            _assert_says(cells, _planned(matrix.tiny_checkpoint(root, "wide"), recipe, kv_cache), recipe)
            checked += 1
    assert checked >= 6


def test_the_mirror_row_is_refused_on_both_tiny_kimi_k3s_as_it_says(root) -> None:
    (cells,) = [cells for first, cells in _rows(KIMI_K3) if MIRROR in _names(first)]
    assert all("not on the tiny model" in c for c in cells), cells
    for tiny in ("default", "wide"):
        report = _planned(matrix.tiny_checkpoint(root, tiny), MIRROR)
        assert [report.results[e].verdict for e in ENGINES] == ["refuses"] * 3, tiny


def test_every_qwen3_moe_row_says_what_the_check_says_on_the_checkpoint_it_names(root) -> None:
    checked, recipe, first = set(), None, ""
    for cell, cells in _rows(QWEN3_MOE):
        if cell:  # a blank recipe cell: the row above's
            first, recipe = cell, _recipe(cell, "qwen3_moe")
        (tiny,) = [t for said, t in QWEN3_CHECKPOINTS.items() if cells[0].startswith(said)]
        _assert_says(cells, _planned(matrix.tiny_checkpoint(root, tiny), recipe), (recipe, tiny))
        if "modelopt-k3-convert" in first:
            _assert_says(cells, _converted(root, tiny, recipe), (recipe, tiny, "converted"))
        checked.add((recipe, tiny))
    recipes = ("presets/nvfp4_default", "presets/nvfp4", "presets/w4a16_nvfp4")
    assert checked == {(r, t) for r in recipes for t in QWEN3_CHECKPOINTS.values()}


def test_every_gpt_oss_row_says_what_the_check_says_on_the_tiny_gpt_oss(root) -> None:
    checked = []
    for first, cells in _rows(GPT_OSS):
        recipe = _recipe(first, "gpt_oss")
        _assert_says(cells, _planned(matrix.tiny_checkpoint(root, "gpt_oss"), recipe), recipe)
        if "modelopt-k3-convert" in first:
            _assert_says(cells, _converted(root, "gpt_oss", recipe), (recipe, "converted"))
        checked.append(recipe)
    assert checked == ["models/openai/gpt-oss/nvfp4", matrix.GPT_OSS_CONVERTER_DEFAULT]
