"""The engines' DeepSeek-V3 rules (``models/deepseek_v3/serving.py``) on the stand-in's calibrated NVFP4 export
(``deepseek_fp8_export``: the project's DeepSeek-V3 nvfp4 recipe) and on that export's layout changed in one place
each: every rule flips a verdict here."""

from __future__ import annotations

import copy

import pytest
import torch

from modelopt_k3.check import check_export
from modelopt_k3.check.engines import replay
from modelopt_k3.check.layout import Layout, Linear, TensorMeta, scan_export
from modelopt_k3.check.report import DIFFERENT, LOADS, REFUSES

ENGINES = ("vllm", "sglang", "trtllm")
ATTN = "model.layers.1.self_attn"


@pytest.fixture(scope="module")
def export_layout(deepseek_fp8_export) -> Layout:
    layout, reader = scan_export(deepseek_fp8_export)
    values = {}
    with reader:
        for lin in layout.linears.values():
            for key in ("weight_scale_2", "input_scale"):
                if key in lin.tensors:
                    values[lin.tensor_name(key)] = layout.value(lin.tensor_name(key))
    layout.read = values.__getitem__
    return layout


def _nvfp4(name: str, out_f: int, in_f: int) -> Linear:
    return Linear(name, {"weight": TensorMeta(torch.uint8, (out_f, in_f // 2)),
                         "weight_scale": TensorMeta(torch.float8_e4m3fn, (out_f, in_f // 16)),
                         "weight_scale_2": TensorMeta(torch.float32, ()),
                         "input_scale": TensorMeta(torch.float32, ())})


def _changed(layout: Layout, *, nvfp4: tuple[str, ...] = (), include: tuple[str, ...] = (), config=None,
             kv: bool = False, extra: tuple[Linear, ...] = ()) -> Layout:
    """``nvfp4``: Linears stored NVFP4 instead; ``include``: their exclude entries dropped (both configs)."""
    out = copy.copy(layout)
    out.linears = dict(layout.linears)
    for name in nvfp4:
        out.linears[name] = _nvfp4(name, *out.linears[name].shape)
    for lin in extra:
        out.linears[lin.name] = lin
    out.hf_quant = copy.deepcopy(layout.hf_quant)
    out.quant = copy.deepcopy(layout.quant)
    q = out.hf_quant["quantization"]
    q["exclude_modules"] = [e for e in q["exclude_modules"] if e not in include]
    out.quant["ignore"] = [e for e in out.quant["ignore"] if e not in include]
    out.config = {**layout.config, **(config or {})}
    if kv:
        q["kv_cache_quant_algo"] = "FP8"
        out.quant["kv_cache_scheme"] = {"type": "float", "num_bits": 8}
        out.kv_scales = {f"model.layers.{i}.self_attn.{k}": TensorMeta(torch.float32, ())
                         for i in range(3) for k in ("k_proj.k_scale", "v_proj.v_scale")}
    return out


def _verdicts(layout: Layout, numerics: bool = False) -> dict:
    return {e: replay(e, layout, numerics=numerics) for e in ENGINES}


def test_the_stand_in_nvfp4_export_loads_on_every_engine(deepseek_fp8_export):
    """Routed/shared experts, dense MLP and o_proj NVFP4; q_a/kv_a/q_b/kv_b, router and lm_head BF16 and excluded."""
    report = check_export(deepseek_fp8_export, ENGINES)
    assert {e: r.verdict for e, r in report.results.items()} == dict.fromkeys(ENGINES, LOADS), report.table()


def test_no_rules_was_the_old_answer(export_layout):
    assert all(r.verdict == LOADS for r in _verdicts(export_layout).values())


def test_an_nvfp4_router_is_refused_by_every_engine(export_layout):
    """Added by hand: ``scan_export`` does not count a module with ``e_score_correction_bias`` as a Linear, so a
    scanned export's router never reaches these rules (the planned layout and hand-built ones do)."""
    router = _nvfp4("model.layers.1.mlp.gate", 8, 256)
    results = _verdicts(_changed(export_layout, extra=(router,), include=("model.layers.1.mlp.gate",)))
    assert all(r.verdict == REFUSES for r in results.values())
    assert "GateLinear built without a quant config" in results["vllm"].refusals[0].reason
    assert "MoEGate is a bare nn.Parameter" in results["sglang"].refusals[0].reason
    assert "DeepseekV3Gate is a bare weight" in results["trtllm"].refusals[0].reason


def test_q_a_and_kv_a_in_different_precisions_are_refused_where_they_are_fused(export_layout):
    kv_a = f"{ATTN}.kv_a_proj_with_mqa"
    results = _verdicts(_changed(export_layout, nvfp4=(kv_a,), include=(kv_a,)))
    assert all(r.verdict == REFUSES for r in results.values()), {e: r.details() for e, r in results.items()}
    assert "some but not all shards" in results["vllm"].refusals[0].reason
    assert "fused_qkv_a_proj" in results["vllm"].refusals[0].reason
    assert "some but not all shards" in results["sglang"].refusals[0].reason
    assert "kv_a_proj_with_mqa as bf16" in results["trtllm"].refusals[0].reason \
        or "q_a_proj" in results["trtllm"].refusals[0].tensor


# Every layer's: SGLang's is_layer_excluded lets an exclude entry ending in q_a_proj / kv_a_proj_with_mqa exclude
# the fused module of *every* layer (check/engines/sglang.py FUSED_PATTERNS).
QKV_A_ALL = tuple(f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in ("q_a_proj", "kv_a_proj_with_mqa"))


def test_nvfp4_q_a_and_kv_a_load_on_vllm_and_sglang_but_not_on_tensorrt_llm(export_layout):
    pieces = QKV_A_ALL
    results = _verdicts(_changed(export_layout, nvfp4=pieces, include=pieces))
    assert results["vllm"].verdict == LOADS and results["sglang"].verdict == LOADS
    assert results["trtllm"].verdict == REFUSES
    assert "copies only the pieces' weight" in results["trtllm"].refusals[0].reason


def test_sglang_serves_kv_a_with_q_a_s_per_tensor_scales(export_layout):
    """0-d scales: SGLang's loader keeps q_a_proj's, so unequal ones are a deviation (vLLM takes the max)."""
    layout = _changed(export_layout, nvfp4=QKV_A_ALL, include=QKV_A_ALL)
    values = {f"{p}.{k}": torch.tensor(0.01 if p.endswith("q_a_proj") else 0.02) for p in QKV_A_ALL
              for k in ("weight_scale_2", "input_scale")}
    base = export_layout.read
    layout.read = lambda name: values[name] if name in values else base(name)
    sglang = replay("sglang", layout)
    assert sglang.verdict == DIFFERENT
    dev = next(d for d in sglang.deviations if d.module == f"{ATTN}.fused_qkv_a_proj_with_mqa")
    assert "only q_a_proj's 0-d scale" in dev.what and dev.error == pytest.approx(0.5)
    vllm = replay("vllm", layout)
    assert any("the engine reads all with the max" in d.what for d in vllm.deviations)


def test_a_quantized_kv_b_proj_is_refused_by_every_engine(export_layout):
    kv_b = f"{ATTN}.kv_b_proj"
    results = _verdicts(_changed(export_layout, nvfp4=(kv_b,), include=(kv_b,)))
    assert all(r.verdict == REFUSES for r in results.values())
    assert "unsettled" in results["vllm"].refusals[0].reason and "identity matrix" in results["vllm"].refusals[0].reason
    assert "w_kc/w_vc" in results["sglang"].refusals[0].reason
    assert "weight_scale_inv" in results["trtllm"].refusals[0].reason


def test_tensorrt_llm_dequantizes_kv_b_proj_when_its_bare_name_is_excluded(export_layout):
    layout = _changed(export_layout)
    layout.hf_quant["quantization"]["exclude_modules"].append("*kv_b_proj")
    result = replay("trtllm", layout, numerics=False)
    assert result.verdict == REFUSES and "bare name kv_b_proj" in result.refusals[0].reason


def test_vllm_drops_modelopt_kv_cache_scales_of_its_mla_attention(export_layout):
    """vLLM 0.33.0 (observed by its own loader: the conformance cell ``deepseek_v3-qformat-nvfp4-kv_fp8``):
    AutoWeightsLoader's cache-scale mapper renames ``self_attn.k_proj.k_scale`` to ``self_attn.attn.k_scale``,
    which DeepSeek's ``maybe_remap_kv_scale_name`` then maps to ``self_attn.attn.attn.k_scale`` -- no parameter (the
    MLA's are on ``self_attn.mla_attn.mla_attn``): every scale dropped, the FP8 cache served with 1.0."""
    layout = _changed(export_layout, kv=True)
    results = _verdicts(layout)
    vllm = results["vllm"]
    assert vllm.verdict == DIFFERENT and not vllm.refusals, vllm.details()
    assert sorted(d.module for d in vllm.deviations) == sorted(layout.kv_scales)
    assert "self_attn.attn.attn.k_scale" in vllm.deviations[0].what and "get_cache_scale_mapper" in vllm.deviations[0].what
    assert results["trtllm"].verdict == REFUSES and "not replayed" in results["trtllm"].refusals[0].reason


def test_sglang_serves_the_mha_prefill_with_kv_scales_of_one(export_layout):
    """SGLang 0.5.23 (observed by its own loader: the conformance cell ``deepseek_v3-qformat-nvfp4-kv_fp8``): the
    scales land on ``attn_mqa`` only; ``attn_mha`` (the MHA prefill's RadixAttention, whose K/V the SM100 trtllm_mla
    prefill quantizes with its scales) keeps 1.0 -- every layer's k and v scale is a deviation, never "loads"."""
    layout = _changed(export_layout, kv=True)
    planned = replay("sglang", layout, numerics=False)
    assert planned.verdict == DIFFERENT and not planned.refusals, planned.details()
    assert sorted(d.module for d in planned.deviations) == sorted(layout.kv_scales)
    assert all("attn_mha" in d.what and "_quantize_fp8_qkv" in d.what for d in planned.deviations)
    values = {name: torch.tensor(0.25) for name in layout.kv_scales}
    layout.read = lambda name: values[name] if name in values else export_layout.read(name)
    measured = replay("sglang", layout, numerics=True)
    assert {d.module: d.error for d in measured.deviations if d.module in values} == {n: 3.0 for n in values}
    # Without a KV-cache quantization the scales are not served (no deviation, the export loads).
    assert replay("sglang", export_layout, numerics=False).verdict == LOADS


def test_sglang_s_own_kv_scale_rename_is_what_loads_them(export_layout):
    from dataclasses import replace

    from modelopt_k3.check.engines.sglang import SGLANG
    from modelopt_k3.models.deepseek_v3.serving import SGLANG_DEEPSEEK_V3

    layout = _changed(export_layout, kv=True)
    without = SGLANG.replay(layout, replace(SGLANG_DEEPSEEK_V3, kv_scale_rename=None), numerics=False)
    assert without.verdict == DIFFERENT and "self_attn.attn.k_scale" in without.deviations[0].what
    with_rename = SGLANG.replay(layout, SGLANG_DEEPSEEK_V3, numerics=False)
    assert with_rename.verdict == LOADS, with_rename.details()


def test_mtp_layers_are_skipped_only_where_the_config_declares_them(export_layout):
    mtp = tuple(Linear(f"model.layers.3.self_attn.{p}", lin.tensors) for p, lin in (
        ("o_proj", export_layout.linears[f"{ATTN}.o_proj"]),))
    undeclared = _verdicts(_changed(export_layout, extra=mtp))
    assert undeclared["vllm"].verdict == REFUSES and "KeyError" in undeclared["vllm"].refusals[0].reason
    assert undeclared["sglang"].verdict == LOADS and undeclared["trtllm"].verdict == LOADS
    declared = _verdicts(_changed(export_layout, extra=mtp, config={"num_nextn_predict_layers": 1}))
    assert all(r.verdict == LOADS for r in declared.values())
    assert all(any("model.layers.3" in w for w in r.warnings) for r in declared.values())


def test_sglang_s_shared_expert_fusion_is_unsettled_for_deepseek_v3_sized_configs(export_layout):
    results = _verdicts(_changed(export_layout, config={"n_routed_experts": 256}))
    assert results["sglang"].verdict == REFUSES and "unsettled" in results["sglang"].refusals[0].reason
    assert results["vllm"].verdict == LOADS
    # An exclude entry naming a shared expert disables the fusion (ModelOptFp4Config.can_fuse_shared_expert).
    layout = _changed(export_layout, config={"n_routed_experts": 256})
    layout.hf_quant["quantization"]["exclude_modules"].append("model.layers.9.mlp.shared_experts")
    assert replay("sglang", layout, numerics=False).verdict == LOADS


def test_the_up_front_check_reads_a_block_fp8_source_and_plans_the_written_layout(deepseek_fp8_ckpt,
                                                                                   deepseek_fp8_export):
    """``--target_engines``' planned layout of the block-FP8 stand-in (``weight`` + ``weight_scale_inv``): every
    Linear is planned (the kept MLA projections as the BF16 weights the export writes), the same tensors as the
    written export, and the same verdicts (it raised KeyError before ``weight_scale_inv`` was a Linear part)."""
    from modelopt_k3.check import check_layout, check_recipe_for_engines, planned_layout
    from modelopt_k3.recipe import load_recipe

    from .conftest import RECIPE

    recipe = load_recipe(RECIPE)
    planned = planned_layout(deepseek_fp8_ckpt, recipe)
    written, reader = scan_export(deepseek_fp8_export)
    with reader:
        assert {n: lin.tensors for n, lin in planned.linears.items()} == \
               {n: lin.tensors for n, lin in written.linears.items()}
    assert planned.linears[f"{ATTN}.kv_a_proj_with_mqa"].fmt == "bf16"
    verdicts = {e: r.verdict for e, r in check_layout(planned, ENGINES, numerics=False).results.items()}
    assert verdicts == {"vllm": LOADS, "sglang": LOADS, "trtllm": LOADS}
    check_recipe_for_engines(deepseek_fp8_ckpt, recipe, ENGINES)  # no refusal
