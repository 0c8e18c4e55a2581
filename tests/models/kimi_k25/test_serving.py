"""The engines' Kimi-K2.5 rules (``models/kimi_k25/serving.py``): DeepSeek-V3's rules replayed on the text model
under the hub's ``language_model.`` names, TensorRT-LLM "not verified", never "loads" by default."""

from __future__ import annotations

import pytest

from modelopt_k3.check.report import LOADS, NOT_VERIFIED, REFUSES

pytestmark = pytest.mark.slow


def test_the_nvfp4_export_loads_in_vllm_and_sglang_and_trtllm_is_not_verified(kimi_k25_export):
    from modelopt_k3.check import check_export

    report = check_export(kimi_k25_export, engines=("vllm", "sglang", "trtllm"))
    verdicts = {engine: r.verdict for engine, r in report.results.items()}
    assert verdicts == {"vllm": LOADS, "sglang": LOADS, "trtllm": NOT_VERIFIED}, report.table()
    for engine in ("vllm", "sglang"):  # observed by the engines' own loaders since (engine_conformance.json)
        assert not any("not verified there" in w for w in report.results[engine].warnings), engine


def test_deepseek_v3_rules_reach_the_prefixed_text_model(kimi_k25_ckpt):
    """A recipe that quantizes every Linear (kv_b_proj too) is refused by both engines' DeepSeek-V3 MLA rule, named
    by the export's own ``language_model.model.layers.N`` names; the vision tower and projector are never named."""
    from modelopt_k3.check.engines import replay
    from modelopt_k3.check.layout import planned_layout
    from modelopt_k3.recipe import load_recipe

    layout = planned_layout(kimi_k25_ckpt, load_recipe("presets/nvfp4_default"))
    for engine in ("vllm", "sglang"):
        result = replay(engine, layout, numerics=False)
        assert result.verdict == REFUSES, engine
        named = {r.tensor for r in result.refusals}
        assert "language_model.model.layers.1.self_attn.kv_b_proj.weight" in named, (engine, sorted(named))
        assert all(t.startswith("language_model.model.layers.") for t in named), (engine, sorted(named))
