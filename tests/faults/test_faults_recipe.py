"""Bad recipes: refused before a weight is read (hf_ptq: in the preflight; the converter: in its plan), in one
line naming the pattern or the import, never quoting a file they should not have read, in milliseconds however
the imports are shaped.
"""

from __future__ import annotations

import re
import textwrap
import time
from pathlib import Path

import pytest

from faults.helpers import SMALL, temp_leftovers
from modelopt_k3.checkpoint import CheckpointReader
from modelopt_k3.recipe import RecipeError, load_recipe

BUDGET_S = 5.0


@pytest.fixture
def no_weight_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self, key, *args):
        raise AssertionError(f"tensor {key} was read before the refusal")

    for name in ("get", "get_rows", "pread"):
        monkeypatch.setattr(CheckpointReader, name, refuse)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _one_line(err: str, prog: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and "Traceback" not in err, err
    return lines[0]


TYPO = """\
    quant_cfg:
      - pattern: "*"
        enable: false
      - pattern: "*self_atn*"
        weights: fp8_pb
        inputs: null
    """
# The converter's default recipe with its experts pattern misspelt: every expert would be decoded to BF16.
EXPERTS_TYPO = """\
    quant_cfg:
      - pattern: "*.block_sparse_moe.exprts*"
        weights: nvfp4
        inputs: nvfp4
        input_amax: 2688.0
    """
VISION = """\
    quant_cfg:
      - pattern: "*"
        weights: nvfp4
        inputs: nvfp4
      - import: units/default_disabled
      - import: units/engine_bf16
      - pattern: "*vision_tower*"
        weights: nvfp4
        inputs: nvfp4
    """


@pytest.mark.parametrize("case", ["typo", "vision"])
def test_hf_ptq_refuses_in_the_preflight(case, tiny_ckpt, tmp_path, run_tool, no_weight_reads) -> None:
    recipe = _write(tmp_path / "r.yaml", {"typo": TYPO, "vision": VISION}[case])
    out = tmp_path / "export"
    t0 = time.perf_counter()
    rc, _, err = run_tool("ptq", ["--pyt_ckpt_path", tiny_ckpt, "--trust_remote_code", "--recipe", recipe,
                                  "--export_path", out, *SMALL])
    assert time.perf_counter() - t0 < BUDGET_S
    line = _one_line(err, "modelopt-k3-ptq")
    want = (r"pattern '\*self_atn\*' matches none of the model's \d+ quantizable modules .*--allow_unmatched"
            if case == "typo" else r"quantizes the inputs of \d+ module\(s\) that text calibration never runs, "
            r"e\.g\. vision_tower\.")
    assert rc == 2 and re.search(want, line), line
    assert not out.exists() and temp_leftovers(out) == []


def test_the_converter_refuses_a_pattern_that_matches_nothing(tiny_ckpt, tmp_path, run_tool) -> None:
    """Not a conversion that decodes every expert to BF16 (an output larger than the source)."""
    recipe = _write(tmp_path / "r.yaml", EXPERTS_TYPO)
    out = tmp_path / "out"
    t0 = time.perf_counter()
    rc, _, err = run_tool("convert", ["--src", tiny_ckpt, "--dst", out, "--recipe", recipe, "--no_progress"])
    assert time.perf_counter() - t0 < BUDGET_S
    assert rc == 2 and "pattern '*.block_sparse_moe.exprts*' matches none" in _one_line(err, "modelopt-k3-convert")
    assert not out.exists()


def test_allow_unmatched_lets_an_unmatched_pattern_pass(tiny_ckpt, tmp_path) -> None:
    from modelopt_k3.quant.decisions import decide
    from modelopt_k3.spec import get_spec

    recipe = _write(tmp_path / "r.yaml", TYPO)
    with CheckpointReader(tiny_ckpt) as reader:
        inventory = reader.inventory()
    spec = get_spec("kimi_k3")
    with pytest.raises(RecipeError, match=r"\*self_atn\*"):
        decide(inventory, spec, load_recipe(recipe), None)
    table = decide(inventory, spec, load_recipe(recipe, overrides={"allow_unmatched": True}), None)
    assert not table.quantized()
    # The presets' imported safety nets (disabled patterns of other models) need no flag.
    decide(inventory, spec, load_recipe("nvfp4"), None)


@pytest.mark.parametrize("how", ["absolute", "relative"])
def test_an_import_outside_the_recipe_roots_is_refused_unread(how, tmp_path) -> None:
    secret = _write(tmp_path / "private" / "secret.yaml", "SECRET-FIRST-LINE: 1\n")
    spec = str(secret) if how == "absolute" else "../private/secret"
    recipe = _write(tmp_path / "mine" / "r.yaml", f"""\
        quant_cfg:
          - import: {spec}
        """)
    with pytest.raises(RecipeError, match=r"resolves to .*secret\.yaml, outside the recipes roots") as info:
        load_recipe(recipe)
    assert "SECRET" not in str(info.value)


def test_a_yaml_error_names_the_place_not_the_content(tmp_path) -> None:
    recipe = _write(tmp_path / "r.yaml", "quant_cfg:\n  - pattern: [SECRET-TOKEN\n")
    with pytest.raises(RecipeError, match=r"not valid \(safe\) YAML: .* at line \d+, column \d+") as info:
        load_recipe(recipe)
    assert "SECRET" not in str(info.value)


def _diamonds(root: Path, levels: int) -> Path:
    """``d0`` imports ``a1`` and ``b1``, which both import ``d1``, ... down to ``d<levels>``: 2**levels paths."""
    _write(root / f"d{levels}.yaml", 'quant_cfg:\n  - pattern: "*"\n    weights: nvfp4\n    inputs: nvfp4\n')
    for i in range(levels - 1, -1, -1):
        for side in "ab":
            _write(root / f"{side}{i + 1}.yaml", f"imports: [./d{i + 1}]\n")
        _write(root / f"d{i}.yaml", f"imports: [./a{i + 1}, ./b{i + 1}]\n")
    return _write(root / "top.yaml", "imports: [./d0]\n")


def test_diamond_imports_are_parsed_once_and_depth_is_capped(tmp_path) -> None:
    t0 = time.perf_counter()
    recipe = load_recipe(_diamonds(tmp_path / "shallow", 7))  # 128 paths to the bottom unit, 15 levels deep
    assert [e.pattern for e in recipe.entries] == ["*"]
    with pytest.raises(RecipeError, match=r"imports nest deeper than 16 levels"):
        load_recipe(_diamonds(tmp_path / "deep", 32))  # 2**32 paths: never finished before
    assert time.perf_counter() - t0 < 2.0
