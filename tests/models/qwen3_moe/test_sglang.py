"""SGLang 0.5.23's Qwen3-MoE rules (``models/qwen3_moe/serving.py``, ``check/engines/sglang.py``) on the planned
exports of the stand-in's variants (headers only): the class ignores ``mlp_only_layers`` (a dense layer's tensors
land nowhere: serves different numbers), the flashinfer_trtllm runner SGLang picks for Qwen3-MoE asserts w2 rows
(the hidden size) % 128 (refuses), and W4A16_NVFP4 experts there run with activation scale 1.0 (different numbers).
Only an all-MoE, 128-wide stand-in loads as calibrated -- what issue 30's engine runs observed."""

from __future__ import annotations

import pytest

from modelopt_k3.check.engines import replay
from modelopt_k3.check.layout import planned_layout
from modelopt_k3.check.report import DIFFERENT, LOADS, REFUSES
from modelopt_k3.recipe import load_recipe
from modelopt_k3.testing.qwen3_moe import make_tiny_qwen3_moe

WIDE = {"hidden_size": 128}
# (variant, recipe) -> SGLang's verdict
EXPECTED = {
    ("dense-64", "nvfp4_default"): REFUSES, ("dense-64", "nvfp4"): REFUSES, ("dense-64", "w4a16_nvfp4"): REFUSES,
    ("moe-64", "nvfp4_default"): REFUSES, ("moe-64", "w4a16_nvfp4"): REFUSES,
    ("dense-128", "nvfp4_default"): DIFFERENT, ("dense-128", "nvfp4"): DIFFERENT, ("dense-128", "w4a16_nvfp4"): DIFFERENT,
    ("moe-128", "nvfp4_default"): LOADS, ("moe-128", "nvfp4"): LOADS, ("moe-128", "w4a16_nvfp4"): DIFFERENT,
}
VARIANTS = {"dense-64": {}, "moe-64": {"mlp_only_layers": []}, "dense-128": WIDE,
            "moe-128": {**WIDE, "mlp_only_layers": []}}


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_sglang")
    return {name: make_tiny_qwen3_moe(root / name, seed=0, **cfg) for name, cfg in VARIANTS.items()}


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "recipe"), sorted(EXPECTED))
def test_sglang_verdict_per_stand_in_variant(stand_ins, variant, recipe):
    result = replay("sglang", planned_layout(stand_ins[variant], load_recipe(recipe)), numerics=False)
    assert result.verdict == EXPECTED[(variant, recipe)], result.details()
    text = "\n".join(result.details())
    if variant.endswith("-64"):
        assert "GEMM2 (w2) 64" in text and "shuffle_matrix_sf_a" in text
    if variant.startswith("dense"):
        assert {d.module for d in result.deviations if "mlp_only_layers" in d.what} == {
            "model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.down_proj"}
    if recipe == "w4a16_nvfp4" and variant.endswith("-128"):
        assert any("fill value 1.0" in d.what for d in result.deviations), text


@pytest.mark.slow
def test_vllm_is_unchanged_by_sglang_s_rules(stand_ins):
    """vLLM builds the dense layer (Qwen3MoeMLP) and pads its experts itself: the stand-in loads there."""
    result = replay("vllm", planned_layout(stand_ins["dense-64"], load_recipe("nvfp4_default")), numerics=False)
    assert result.verdict == LOADS, result.details()


def test_a_mixed_config_with_w4a16_experts_runs_on_marlin():
    """``_qwen3_moe_family_overrides``: only modelopt_mixed with W4A16_NVFP4 ``.experts`` layers picks marlin."""
    from modelopt_k3.check.layout import Layout
    from modelopt_k3.models.qwen3_moe.serving import sglang_moe_runner

    def layout(quant):
        return Layout(config={"model_type": "qwen3_moe"}, quant=quant, hf_quant=None, linears={}, kv_scales={},
                      tensors={})

    mixed = {"quant_method": "modelopt_mixed",
             "quantized_layers": {"model.layers.0.mlp.experts": {"quant_algo": "W4A16_NVFP4"}}}
    assert sglang_moe_runner(layout(mixed)) == "marlin"
    assert sglang_moe_runner(layout({**mixed, "quant_method": "modelopt"})) == "flashinfer_trtllm"
    assert sglang_moe_runner(layout(None)) == "flashinfer_trtllm"
