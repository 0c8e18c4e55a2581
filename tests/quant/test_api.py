"""``QuantPlan`` (quant/api.py): what a run's summary says."""

from __future__ import annotations


def test_the_summary_counts_source_labels_without_their_module_names():
    """The Kimi-K3 mirror recipe printed one "source bytes" line per attention projection (30 on the tiny model,
    ~500 at full size), each naming its module; they are one line with their count."""
    from modelopt_k3.quant.api import QuantPlan
    from modelopt_k3.quant.block_fp8_source import PASSTHROUGH
    from modelopt_k3.quant.decisions import DecisionTable
    from modelopt_k3.recipe import load_recipe

    recipe = load_recipe("presets/nvfp4")
    names = [f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in ("q_proj", "o_proj")]
    labels = {n: f"max (requantized: {n} is not stored block-FP8)" for n in names} | {"lm_head": PASSTHROUGH}
    plan = QuantPlan(recipe, DecisionTable(recipe, {}), load=None, source_labels=labels)
    lines = [line for line in plan.summary().splitlines() if "source bytes" in line]
    assert lines == ["  source bytes:       6 max (requantized: <module> is not stored block-FP8)",
                     f"  source bytes:       1 {PASSTHROUGH}"]
