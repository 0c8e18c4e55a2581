"""TensorRT-LLM's Qwen3-MoE rules (``models/qwen3_moe/serving.py`` ``replay_trtllm``) on hand-built headers.

Each test changes one thing of a layout TensorRT-LLM loads (NVFP4 everywhere, router and lm_head excluded, q/k/v
and each expert's w1/w3 sharing their per-tensor scales) and asserts the verdict that one rule gives.
"""

from __future__ import annotations

import pytest
import torch

from modelopt_k3.check.engines import replay
from modelopt_k3.check.layout import Layout, Linear, TensorMeta
from modelopt_k3.check.report import DIFFERENT, LOADS, REFUSES

H, INTER, E = 64, 32, 2  # hidden, expert intermediate, experts
ATTN = "model.layers.0.self_attn"
EXPERTS = "model.layers.0.mlp.experts"


def _nvfp4(name: str, out_f: int, in_f: int, values: dict, ws2: float = 0.01, inp: float = 0.02) -> Linear:
    values[f"{name}.weight_scale_2"] = torch.tensor(ws2)
    values[f"{name}.input_scale"] = torch.tensor(inp)
    return Linear(name, {"weight": TensorMeta(torch.uint8, (out_f, in_f // 2)),
                         "weight_scale": TensorMeta(torch.float8_e4m3fn, (out_f, in_f // 16)),
                         "weight_scale_2": TensorMeta(torch.float32, ()),
                         "input_scale": TensorMeta(torch.float32, ())})


def _bf16(name: str, out_f: int, in_f: int) -> Linear:
    return Linear(name, {"weight": TensorMeta(torch.bfloat16, (out_f, in_f))})


def _layout(algo: str = "NVFP4", exclude=("lm_head", "model.embed_tokens", "model.layers.*.mlp.gate"),
            scales: dict | None = None, bf16: tuple[str, ...] = (), extra: tuple[Linear, ...] = ()) -> Layout:
    """``scales``: Linear name -> (weight_scale_2, input_scale) overrides; ``bf16``: Linears stored BF16."""
    values: dict[str, torch.Tensor] = {}
    shapes = {f"{ATTN}.{p}": (H, H) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    for e in range(E):
        shapes |= {f"{EXPERTS}.{e}.gate_proj": (INTER, H), f"{EXPERTS}.{e}.up_proj": (INTER, H),
                   f"{EXPERTS}.{e}.down_proj": (H, INTER)}
    linears = {}
    for name, (o, i) in shapes.items():
        ws2, inp = (scales or {}).get(name, (0.01, 0.02))
        linears[name] = _bf16(name, o, i) if name in bf16 else _nvfp4(name, o, i, values, ws2, inp)
    for lin in (_bf16("model.layers.0.mlp.gate", E, H), _bf16("lm_head", 128, H), *extra):
        linears[lin.name] = lin
    hf_quant = {"producer": {"name": "modelopt"},
                "quantization": {"quant_algo": algo, "exclude_modules": list(exclude), "kv_cache_quant_algo": None}}
    return Layout(config={"model_type": "qwen3_moe"}, quant={"quant_method": "modelopt", "quant_algo": algo},
                  hf_quant=hf_quant, linears=linears, kv_scales={}, tensors={}, read=values.__getitem__)


def _trt(layout: Layout):
    return replay("trtllm", layout)


def test_the_nvfp4_export_layout_loads():
    result = _trt(_layout())
    assert result.verdict == LOADS, result.refusals


def test_a_dense_mlp_layer_is_refused():
    """Qwen3MoEDecoderLayer builds every mlp as Qwen3MoE: an mlp_only_layers layer has nothing to load into."""
    dense = tuple(_bf16(f"model.layers.1.mlp.{p}", *s) for p, s in
                  (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)), ("down_proj", (H, INTER))))
    result = _trt(_layout(extra=dense))
    assert result.verdict == REFUSES
    assert {r.tensor for r in result.refusals} == {f"model.layers.1.mlp.{p}.weight" for p in ("down_proj", "gate_proj",
                                                                                             "up_proj")}
    assert "every layer's mlp as Qwen3MoE" in result.refusals[0].reason


def test_the_router_is_a_bare_bf16_weight_whatever_the_exclusions():
    router = _nvfp4("model.layers.0.mlp.gate", E, H, {})  # NVFP4 and not excluded: still a plain parameter
    result = _trt(_layout(exclude=("lm_head",), extra=(router,)))
    assert [r.tensor for r in result.refusals] == ["model.layers.0.mlp.gate.weight"]
    assert "Qwen3Gate" in result.refusals[0].reason


def test_a_quantized_lm_head_is_unsettled():
    values: dict = {}
    head = _nvfp4("lm_head", 128, H, values)
    result = _trt(_layout(exclude=("model.layers.*.mlp.gate",), extra=(head,)))
    assert [r.tensor for r in result.refusals] == ["lm_head.weight"] and "not read" in result.refusals[0].reason
    result = _trt(_layout(exclude=("model.layers.*.mlp.gate",)))  # BF16 but not excluded: also not settled
    assert [r.tensor for r in result.refusals] == ["lm_head.weight"]


def test_nothing_declared_means_everything_is_built_bf16():
    layout = _layout()
    layout.hf_quant = layout.quant = None
    result = _trt(layout)
    assert result.verdict == REFUSES and "declares no quant_algo" in result.refusals[0].reason


@pytest.mark.parametrize("key", [0, 1])  # 0: weight_scale_2, 1: input_scale
def test_qkv_pieces_must_share_their_nvfp4_scales(key):
    """NVFP4LinearMethod.load_weight_scales asserts equal per-tensor scales across q/k/v (vLLM takes the max)."""
    override = [0.01, 0.02]
    override[key] *= 2
    result = _trt(_layout(scales={f"{ATTN}.k_proj": tuple(override)}))
    assert result.verdict == REFUSES
    assert result.refusals[0].tensor.startswith(f"{ATTN}.q_proj.")
    assert "load_weight_scales" in result.refusals[0].reason


def test_excluding_q_k_v_by_their_own_names_leaves_qkv_proj_quantized():
    """exclude_modules is fnmatched against the engine module (qkv_proj), not the checkpoint pieces."""
    pieces = tuple(f"{ATTN}.{p}" for p in ("q_proj", "k_proj", "v_proj"))
    result = _trt(_layout(exclude=("lm_head", "model.layers.*.mlp.gate", *pieces), bf16=pieces))
    assert result.verdict == REFUSES
    assert "builds model.layers.0.self_attn.qkv_proj as nvfp4" in result.refusals[0].reason
    # A pattern matching the fused name itself excludes it.
    assert _trt(_layout(exclude=("lm_head", "model.layers.*.mlp.gate", f"{ATTN}*"),
                        bf16=(*pieces, f"{ATTN}.o_proj"))).verdict == LOADS


@pytest.mark.parametrize("key", [0, 1])
def test_an_experts_gate_and_up_must_share_their_scales(key):
    override = [0.01, 0.02]
    override[key] *= 2
    result = _trt(_layout(scales={f"{EXPERTS}.1.up_proj": tuple(override)}))
    assert result.verdict == REFUSES
    assert result.refusals[0].tensor.startswith(f"{EXPERTS}.1.gate_proj.")
    assert "load_expert_fc31" in result.refusals[0].reason


def test_expert_input_scales_that_differ_across_experts_are_maxed():
    result = _trt(_layout(scales={f"{EXPERTS}.1.down_proj": (0.01, 0.04)}))
    assert result.verdict == DIFFERENT
    assert result.deviations[0].error == pytest.approx(1.0)


@pytest.mark.parametrize(("algo", "why"), [("MIXED_PRECISION", "quant_cfg.json vs quantized_layers"),
                                          ("W4A16_NVFP4", "absent from QuantAlgo"), ("FP8_PB_WO", "not one this check")])
def test_algos_this_check_does_not_settle_are_refused(algo, why):
    result = _trt(_layout(algo=algo))
    assert [r.tensor for r in result.refusals] == ["hf_quant_config.json"]
    assert algo in result.refusals[0].reason and why in result.refusals[0].reason


def test_an_exclusion_matching_only_an_ancestor_is_unsettled():
    """Older builds fnmatch the module's own name, newer ones also its ancestors: the rule refuses, not guesses."""
    pieces = tuple(f"{ATTN}.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    result = _trt(_layout(exclude=("lm_head", "model.layers.*.mlp.gate", ATTN), bf16=pieces))
    assert result.verdict == REFUSES
    assert {r.tensor for r in result.refusals} == {f"{ATTN}.o_proj", f"{ATTN}.qkv_proj"}
    assert "unsettled" in result.refusals[0].reason


@pytest.mark.slow
def test_recipes_on_the_tiny_stand_in_as_planned(tmp_path):
    """The recipes' planned exports (headers only): the stand-in's dense mlp_only_layers=[1] layer is TensorRT-LLM's
    only objection; without it NVFP4 (default and attention-BF16 preset) loads, W4A16_NVFP4 is refused up front."""
    from modelopt_k3.check.layout import planned_layout
    from modelopt_k3.recipe import load_recipe
    from modelopt_k3.testing.qwen3_moe import make_tiny_qwen3_moe

    with_dense = make_tiny_qwen3_moe(tmp_path / "dense", seed=0)
    all_moe = make_tiny_qwen3_moe(tmp_path / "moe", seed=0, mlp_only_layers=[])
    for recipe in ("nvfp4_default", "nvfp4"):
        refused = replay("trtllm", planned_layout(with_dense, load_recipe(recipe)), numerics=False).refusals
        assert {r.tensor.rsplit(".", 2)[0] for r in refused} == {"model.layers.1.mlp"}, refused
        assert replay("trtllm", planned_layout(all_moe, load_recipe(recipe)), numerics=False).verdict == LOADS
    refused = replay("trtllm", planned_layout(all_moe, load_recipe("w4a16_nvfp4")), numerics=False).refusals
    assert [r.tensor for r in refused] == ["hf_quant_config.json"]
