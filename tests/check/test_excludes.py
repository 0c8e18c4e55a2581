"""The engines' exclude matching, indexed (``check/engines/excludes.py``): the same answers as the engines' own
loops over every entry (kept here as the reference), and a check whose time grows with the manifest's size, not
with entries x modules (issue 31: 10^6 exclude entries ran > 180 s)."""

from __future__ import annotations

import json
import random
import re
import shutil
import time
from fnmatch import fnmatch, fnmatchcase
from pathlib import Path

import pytest

from modelopt_k3.check.engines.excludes import ExcludeIndex

# --------------------------------------------------------------------------- the engines' loops, as they read


def ref_substring(name: str, entries: list[str], except_equal_to: str | None) -> bool:
    return any(e != except_equal_to and e in name for e in entries)  # vLLM is_layer_excluded's substring rule


def ref_inside_experts(name: str, entries: list[str]) -> bool:
    return any(name in e for e in entries if "experts" in e)  # is_layer_skipped's experts rule (both engines)


def ref_fnmatch(name: str, entries: list[str], case: bool) -> bool:
    return any((fnmatchcase if case else fnmatch)(name, e) for e in entries)


def ref_first_fnmatchcase(name: str, entries: list[str]) -> str | None:
    return next((e for e in entries if fnmatchcase(name, e)), None)


def ref_module_path(prefix: str, entries: list[str]) -> bool:  # SGLang utils._module_path_match, per entry
    def match(ignored: str, prefix: str) -> bool:
        ignored, prefix = ignored.rstrip("."), prefix.rstrip(".")
        return ignored == prefix or prefix.startswith(ignored + ".") or f".{ignored}." in f".{prefix}."

    return any(match(e, prefix) for e in entries)


def ref_regex(names: list[str], entries: list[str]) -> bool:  # SGLang modelopt.is_layer_excluded's glob
    return any(re.fullmatch(e.replace(".", r"\.").replace("*", ".*"), n) for e in entries for n in names)


PARTS = ["model", "language_model", "layers", "0", "1", "12", "self_attn", "q_proj", "kv_a_proj_with_mqa",
         "mlp", "experts", "3", "gate_up_proj", "down_proj", "shared_experts", "lm_head", "a", "b"]


def _name(rng: random.Random) -> str:
    return ".".join(rng.choice(PARTS) for _ in range(rng.randint(1, 6)))


def _entry(rng: random.Random) -> str:
    """Entries of every kind the matching rules treat differently: whole names, pieces, trailing dots,
    wildcards, character classes, regex characters SGLang does not escape."""
    base = _name(rng)
    cut = rng.randint(0, len(base))
    return rng.choice([
        base, base[:cut], base[cut:], base + ".", f"*{base}", f"{base}*", f"{base[:cut]}*{base[cut:]}",
        base.replace("1", "?"), base.replace("0", "[01]"), f"{base}(x)", f"{base}+", "", "*",
    ])


@pytest.mark.parametrize("loop_below", [0, ExcludeIndex.LOOP_BELOW], ids=["indexed", "looped"])
@pytest.mark.parametrize("seed", range(6))
def test_the_index_answers_as_each_engines_loop_does(seed: int, loop_below: int, monkeypatch) -> None:
    monkeypatch.setattr(ExcludeIndex, "LOOP_BELOW", loop_below)  # both ways of answering a short list
    rng = random.Random(seed)
    entries = [_entry(rng) for _ in range(rng.randint(0, 40))]
    index = ExcludeIndex(entries)
    for _ in range(400):
        name = _name(rng)
        other = rng.choice([None, name, _name(rng)])
        assert index.has_substring_of(name, except_equal_to=other) == ref_substring(name, entries, other), (name, other)
        assert index.inside_an_experts_entry(name) == ref_inside_experts(name, entries), name
        for case in (False, True):
            assert index.fnmatch_any(name, case=case) == ref_fnmatch(name, entries, case), name
        assert index.first_fnmatchcase(name) == ref_first_fnmatchcase(name, entries), name
        assert index.module_path_match(name) == ref_module_path(name, entries), name
        names = [name, *name.split(".")]
        assert index.regex_fullmatch_any(names) == ref_regex(names, entries), name
        assert (name in index) == (name in entries)


def test_entries_with_special_characters_never_match_themselves_by_equality() -> None:
    """``a[b]`` as fnmatch is "a" then "b": the literal name ``a[b]`` does not match it (nor ``x(y)`` as
    SGLang's regex), so the index's equality shortcut must leave such entries to the pattern match."""
    index = ExcludeIndex(["a[b]", "x(y)"])
    assert not index.fnmatch_any("a[b]") and index.fnmatch_any("ab")
    assert not index.regex_fullmatch_any(["x(y)"]) and index.regex_fullmatch_any(["xy"])


@pytest.mark.slow
def test_a_manifest_with_a_million_exclude_entries_is_checked_in_seconds(tiny_ckpt: Path, tmp_path: Path) -> None:
    """The converter's export, its ``exclude_modules`` grown by 10^6 entries that match no module: every
    engine's verdict is the same as without them, and the check's time is the manifest's parse plus a
    constant per module (it was entries x modules: minutes)."""
    from modelopt_k3 import convert_checkpoint
    from modelopt_k3.check import ENGINE_NAMES, check_export
    from modelopt_k3.recipe import load_recipe

    out = tmp_path / "export"
    convert_checkpoint(tiny_ckpt, out, load_recipe("models/moonshotai/Kimi-K3/nvfp4_experts"), workers=1)
    base = check_export(out, ENGINE_NAMES)
    grown = tmp_path / "grown"
    shutil.copytree(out, grown)
    extra = [f"model.layers.{i}.nothing_here.{j}" for i in range(1000) for j in range(1000)]
    for name, where in (("hf_quant_config.json", ("quantization",)), ("config.json", ("quantization_config",))):
        path = grown / name
        doc = json.loads(path.read_text())
        quant = doc
        for key in where:
            quant = quant[key]
        key = "exclude_modules" if "exclude_modules" in quant else "ignore"
        quant[key] = list(quant.get(key) or []) + extra
        path.write_text(json.dumps(doc))
    t0 = time.perf_counter()
    report = check_export(grown, ENGINE_NAMES)
    seconds = time.perf_counter() - t0
    assert {e: r.verdict for e, r in report.results.items()} == {e: r.verdict for e, r in base.results.items()}
    assert seconds < 60, f"the check of a 10^6-entry manifest took {seconds:.1f} s"


def test_trtllm_exclusion_matches_a_subtree_root_and_re_entries_as_its_quant_config_does() -> None:
    """TensorRT-LLM's ``QuantConfig.is_module_excluded_from_quantization`` (replayed by tools/conformance/trtllm.py):
    the name or an ancestor by ``fnmatchcase``; ``re:`` entries by ``re.fullmatch``; ``x.*`` also matches ``x``
    itself. The replay's cell ``manifest-bank-excluded-subtree`` (``<bank>.*``) raised where the check had said
    "loads correctly" (it matched ``x.*`` by fnmatch only)."""
    from modelopt_k3.check.engines.trtllm import trt_excluded_or_ancestor

    bank = "language_model.model.layers.1.block_sparse_moe.experts"
    assert trt_excluded_or_ancestor(bank, ExcludeIndex([f"{bank}.*"]))
    assert trt_excluded_or_ancestor(f"{bank}.3.w1", ExcludeIndex([f"{bank}.*"]))
    assert trt_excluded_or_ancestor(bank, ExcludeIndex(["language_model.model.layers.1"]))  # an ancestor, no glob
    assert trt_excluded_or_ancestor(bank, ExcludeIndex([r"re:.*\.layers\.1\.block_sparse_moe\.experts"]))
    assert trt_excluded_or_ancestor(f"{bank}.0.w1", ExcludeIndex([r"re:.*\.experts"]))  # via an ancestor
    assert not trt_excluded_or_ancestor(bank, ExcludeIndex([r"re:.*\.layers\.2\..*", "re:(unclosed", f"{bank}.0.*"]))
    assert not trt_excluded_or_ancestor("language_model.model.layers.1.mlp", ExcludeIndex(["*.layers.1.mlp.*x"]))


def test_trtllm_warns_about_config_json_group_size_only_where_it_differs_from_the_file() -> None:
    """TensorRT-LLM's ``warn_if_inline_diverges`` (replayed): the inline ModelOpt config's group_size against
    hf_quant_config.json's. Both absent (the FP8 presets) is no warning; the replay's preset-fp8 and mlp0-fp8_pb
    cells showed the check warning there."""
    from types import SimpleNamespace

    from modelopt_k3.check.engines.trtllm import config_json_group_size_warning

    def layout(inline, file_group):
        quant = {"quant_algo": "FP8"} if file_group is None else {"quant_algo": "NVFP4", "group_size": file_group}
        return SimpleNamespace(quant=inline, hf_quant={"quantization": quant})

    modelopt = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    (warning,) = config_json_group_size_warning(layout(modelopt, 16))
    assert "has no group_size, hf_quant_config.json 16" in warning
    assert config_json_group_size_warning(layout({**modelopt, "group_size": 16}, 16)) == []
    assert config_json_group_size_warning(layout(modelopt, None)) == []  # both absent
    assert "has group_size 32" in config_json_group_size_warning(layout({**modelopt, "group_size": 32}, 16))[0]
    assert config_json_group_size_warning(layout({"quant_method": "fp8"}, 16)) == []  # not a ModelOpt config
    assert config_json_group_size_warning(SimpleNamespace(quant=modelopt, hf_quant=None)) == []  # no file
