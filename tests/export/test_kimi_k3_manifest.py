"""Kimi-K3 MIXED_PRECISION manifests, spelled the way the engines look them up (issue 17 part 1).

The golden files (``tests/data/modelopt_kimi_k3_converter/*.json``) are what ModelOpt's own Kimi-K3
converter wrote for the tiny checkpoint (their ``generated_by`` says which commit, version and
arguments): data, generated once in a scratch venv. They depend on the tiny model's module tree,
not on its weight values. Our manifest (the one writer, ``export/modelopt_format.hf_quant_config``,
seen through ``planned_layout``, which the exporters' own tests tie to what they write) must hold
every entry and every exclude pattern of theirs with the same algorithm.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelopt_k3.check.layout import planned_layout
from modelopt_k3.models.kimi_k3.manifest import aliases
from modelopt_k3.recipe import load_recipe

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "modelopt_kimi_k3_converter"
RECIPES = {"mirror": "models/moonshotai/Kimi-K3/nvfp4_experts-fp8_pb_attention",
           "nvfp4_experts": "models/moonshotai/Kimi-K3/nvfp4_experts"}
LM = "language_model.model"


def _ours(tiny_ckpt: Path, recipe: str) -> tuple[dict, dict]:
    layout = planned_layout(tiny_ckpt, load_recipe(recipe))
    return layout.hf_quant, layout.quant


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_manifest_is_a_superset_of_modelopts_kimi_k3_converter(tiny_ckpt: Path, name: str):
    golden = json.loads((GOLDEN / f"{name}.json").read_text())
    hf, qc = _ours(tiny_ckpt, RECIPES[name])
    ours, theirs = hf["quantization"], golden["hf_quant_config"]["quantization"]
    for key in ("quant_algo", "kv_cache_quant_algo", "group_size"):
        assert ours[key] == theirs[key], key
    missing = {k: v for k, v in theirs["quantized_layers"].items() if ours["quantized_layers"].get(k) != v}
    assert not missing, f"{len(missing)} of ModelOpt's entries missing or with another algo: {sorted(missing)[:8]}"
    assert not set(theirs["exclude_modules"]) - set(ours["exclude_modules"])

    theirs_qc = golden["quantization_config"]
    assert qc["quant_method"] == theirs_qc["quant_method"] == "modelopt_mixed"
    assert qc["quant_algo"] == "MIXED_PRECISION" and not set(theirs_qc["ignore"]) - set(qc["ignore"])
    assert qc["quantized_layers"] == ours["quantized_layers"]
    # Every config group of theirs has one of ours with the same arguments and at least its targets.
    groups = [({k: v for k, v in g.items() if k != "targets"}, set(g["targets"])) for g in qc["config_groups"].values()]
    for group in theirs_qc["config_groups"].values():
        args = {k: v for k, v in group.items() if k != "targets"}
        assert any(a == args and t >= set(group["targets"]) for a, t in groups), args


def test_routed_experts_are_declared_per_bank_only(tiny_ckpt: Path):
    """No engine reads per-expert entries (TensorRT-LLM asks for the bank; vLLM and SGLang find the
    bank's algo by its own name), so there are none; each bank is there in all six spellings."""
    hf, _ = _ours(tiny_ckpt, RECIPES["mirror"])
    layers = hf["quantization"]["quantized_layers"]
    assert not [k for k in layers if ".experts." in k]
    bank = f"{LM}.layers.2.block_sparse_moe.experts"
    spellings = [bank, f"{LM}.layers.2.mlp.experts", "model.layers.2.block_sparse_moe.experts",
                 "layers.2.block_sparse_moe.experts", "model.layers.2.mlp.experts", "layers.2.mlp.experts"]
    assert sorted(aliases(bank)) == sorted(spellings)
    assert all(layers[s] == {"quant_algo": "NVFP4", "group_size": 16} for s in spellings)


def test_fused_names_only_where_every_member_shares_the_algo(tiny_ckpt: Path):
    hf, _ = _ours(tiny_ckpt, RECIPES["mirror"])
    layers = hf["quantization"]["quantized_layers"]
    for fused in ("fused_qkvg_proj", "in_proj_qkvgfab"):  # KDA layer 0: q/k/v/g/f_a/b all FP8_PB_WO
        assert layers[f"model.layers.0.self_attn.{fused}"] == {"quant_algo": "FP8_PB_WO"}
    for fused in ("fused_qkv_a_proj_with_mqa", "fused_qkv_a_proj", "fused_qkv_a_g_proj"):  # MLA layer 3
        assert layers[f"layers.3.self_attn.{fused}"] == {"quant_algo": "FP8_PB_WO"}
    # nvfp4_experts leaves attention as stored: no attention entry at all, and f_b_proj excluded by pattern.
    hf, _ = _ours(tiny_ckpt, RECIPES["nvfp4_experts"])
    assert not [k for k in hf["quantization"]["quantized_layers"] if "self_attn" in k]
    assert "*self_attn.f_b_proj*" in hf["quantization"]["exclude_modules"]


def test_a_fused_module_with_an_unquantized_member_gets_no_entry():
    from modelopt_k3.export.modelopt_format import hf_quant_config
    from modelopt_k3.models.kimi_k3.manifest import KIMI_K3_MANIFEST

    attn = f"{LM}.layers.0.self_attn"
    algos = {f"{attn}.{p}": "FP8_PB_WO" for p in ("q_proj", "k_proj", "v_proj")}
    q = hf_quant_config({**algos, f"{LM}.layers.1.block_sparse_moe.experts.0.w1": "NVFP4"}, kv_cache=None,
                        unquantized=[f"{attn}.g_proj"], naming=KIMI_K3_MANIFEST)["quantization"]
    assert not [k for k in q["quantized_layers"] if "fused_qkvg_proj" in k or "in_proj_qkvgfab" in k]
    assert q["quantized_layers"]["layers.0.self_attn.q_proj"] == {"quant_algo": "FP8_PB_WO"}
    # A never-quantized pattern that would match a quantized module is not written.
    q = hf_quant_config({f"{LM}.layers.1.block_sparse_moe.shared_experts.up_proj": "FP8_PB_WO",
                         f"{LM}.layers.1.block_sparse_moe.experts.0.w1": "NVFP4"}, kv_cache=None, unquantized=[],
                        naming=KIMI_K3_MANIFEST)["quantization"]
    assert not [p for p in q["exclude_modules"] if "shared_experts" in p]
