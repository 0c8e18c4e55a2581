"""The decision table and the shared-input probe (quant/decisions.py, quant/shared_inputs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelopt_k3.checkpoint import CheckpointReader, read_config
from modelopt_k3.export.modelopt_format import hf_quant_config, summarize_exclusions
from modelopt_k3.load import resolve_model_class
from modelopt_k3.quant.decisions import decide
from modelopt_k3.quant.shared_inputs import SharedInputRule, apply_rules, discover_shared_inputs
from modelopt_k3.recipe import RecipeError, load_recipe, recipe_from_dict
from modelopt_k3.spec import get_spec

pytestmark = pytest.mark.usefixtures("restore_remote_code")
SPEC = get_spec("kimi_k3")
KDA = ("b_proj", "f_a_proj", "g_proj", "k_proj", "q_proj", "v_proj")
MLA = ("g_proj", "kv_a_proj_with_mqa", "q_a_proj")


@pytest.fixture(scope="module")
def rules(tiny_ckpt: Path) -> tuple[SharedInputRule, ...]:
    SPEC.loading.build(tiny_ckpt)
    model_cls, config = resolve_model_class(tiny_ckpt, read_config(tiny_ckpt), trust_remote_code=True)
    return discover_shared_inputs(SPEC, model_cls, config)


@pytest.fixture(scope="module")
def inventory(tiny_ckpt: Path):
    with CheckpointReader(tiny_ckpt) as reader:
        return reader.inventory()


def test_probe_finds_the_fused_projections_without_layer_indices(rules) -> None:
    layers = "language_model.model.layers.*"
    assert set(rules) == {
        SharedInputRule(f"{layers}.self_attn", KDA),
        SharedInputRule(f"{layers}.self_attn", MLA),
        SharedInputRule(f"{layers}.mlp", ("gate_proj", "up_proj")),
        SharedInputRule(f"{layers}.block_sparse_moe.shared_experts", ("gate_proj", "up_proj")),
    }


def test_rules_apply_to_any_layer_count(rules) -> None:
    """Kimi-K3-like names, 7 layers (KDA and MLA interleaved, some projections absent): each layer's group
    is the rule whose members are all present; a rule never claims a module twice."""
    names = set()
    for i in range(7):
        attn = f"language_model.model.layers.{i}.self_attn"
        names |= {f"{attn}.{p}" for p in (MLA if i % 3 == 2 else KDA)} | {f"{attn}.o_proj"}
        names |= {f"language_model.model.layers.{i}.block_sparse_moe.shared_experts.{p}" for p in ("gate_proj", "up_proj")}
    names.discard("language_model.model.layers.4.self_attn.b_proj")  # a variant without it: the KDA rule does not apply
    groups = apply_rules(rules, names)
    assert len(groups) == 6 + 7 and len({m for g in groups for m in g}) == sum(len(g) for g in groups)
    assert ("language_model.model.layers.2.self_attn.g_proj", "language_model.model.layers.2.self_attn.kv_a_proj_with_mqa",
            "language_model.model.layers.2.self_attn.q_a_proj") in groups


# presets/nvfp4 keeps attention BF16 (units/engine_bf16); these tests need its groups quantized.
ATTENTION_NVFP4 = {"pattern": "*.self_attn.*", "weights": "nvfp4", "inputs": "nvfp4"}


def test_table_groups_only_quantized_members_and_refuses_mixed_formats(inventory, rules) -> None:
    recipe = load_recipe("presets/nvfp4", overrides={"quant_cfg": [ATTENTION_NVFP4, {"pattern": "*.self_attn.q_a_proj", "enable": False}]})
    table = decide(inventory, SPEC, recipe, rules)
    mla = "language_model.model.layers.3.self_attn"
    assert (f"{mla}.g_proj", f"{mla}.kv_a_proj_with_mqa") in table.groups.values()
    assert table.decisions[f"{mla}.q_a_proj"].group is None and not table.decisions[f"{mla}.q_a_proj"].quantized
    assert table.decisions[f"{mla}.g_proj"].group == f"{mla}.g_proj+{mla}.kv_a_proj_with_mqa"
    mixed = load_recipe("presets/nvfp4", overrides={"quant_cfg": [
        ATTENTION_NVFP4, {"pattern": "*.self_attn.q_a_proj", "weights": "fp8_pb", "inputs": None}]})
    with pytest.raises(RecipeError, match=r"q_a_proj read the same input .* one format"):
        decide(inventory, SPEC, mixed, rules)
    # Per-tensor FP8 groups share their scales too (issue 41: engines fuse them and requantize to the max; ModelOpt
    # 0.47 skips them), the same groups as NVFP4's; block FP8 shares nothing (scales stay per block), and a recipe
    # without a dense format that shares never runs the probe.
    fp8 = decide(inventory, SPEC, load_recipe("presets/fp8"), rules)
    all_nvfp4 = load_recipe("presets/nvfp4", overrides={"quant_cfg": [
        {"pattern": "*", "weights": "nvfp4", "inputs": "nvfp4"}, {"import": "units/default_disabled"}]})
    assert fp8.groups and fp8.groups == decide(inventory, SPEC, all_nvfp4, rules).groups
    block = load_recipe("models/moonshotai/Kimi-K3/nvfp4_experts-fp8_pb_attention")
    assert decide(inventory, SPEC, block, rules).groups == {}
    experts_only = load_recipe("models/moonshotai/Kimi-K3/nvfp4_experts")
    assert decide(inventory, SPEC, experts_only, lambda: pytest.fail("probe ran")).rules is None
    assert decide(inventory, SPEC, recipe, lambda: rules).groups == table.groups
    # Without the rules, a recipe whose groups would share scales is refused; experts-only is not.
    with pytest.raises(RecipeError, match="trust_remote_code"):
        decide(inventory, SPEC, recipe, None).check_groups_known()
    decide(inventory, SPEC, load_recipe("models/moonshotai/Kimi-K3/nvfp4_experts"), None).check_groups_known()


def test_exclude_modules_equal_modelopt_0_47(inventory, rules) -> None:
    """The same choice of quantized modules as the golden ModelOpt run gives its hf_quant_config exactly."""
    golden = json.loads((Path(__file__).parents[1] / "data" / "modelopt_0_47_golden.json").read_text())
    recipe = load_recipe("presets/w4a16_nvfp4", overrides={"quant_cfg": [
        {"pattern": "*.block_sparse_moe.experts*", "enable": False}]})
    table = decide(inventory, SPEC, recipe, rules)
    ours = hf_quant_config(table.layer_algos(), kv_cache=None, unquantized=table.unquantized_modules())
    assert ours["quantization"] == golden["w4a16_nvfp4_hf_quant_config"]
    assert ours["producer"] == {"name": "modelopt", "version": "0.47.0"}


def test_summarize_exclusions_prefix_wildcards() -> None:
    """Hand-worked: the shortest dotted prefix wildcard that hits no quantized module, else the name."""
    quantized = {"a.b.c", "a.bc.d", "m.x.1"}
    assert summarize_exclusions(["x.y", "a.b.d", "a.b", "m.y.2", "m.y.3", "m.x"], quantized) == [
        "a.b", "a.b.d", "m.x", "m.y*", "x*"]


def test_quantize_refuses_a_group_with_two_formats(tiny_ckpt) -> None:
    from modelopt_k3 import load_pretrained, quantize

    model = load_pretrained(tiny_ckpt, trust_remote_code=True, progress=False)
    recipe = recipe_from_dict({"quant_cfg": [
        {"pattern": "*.self_attn.*_proj", "weights": "nvfp4", "inputs": None},
        {"pattern": "*.self_attn.k_proj", "weights": "fp8", "inputs": "fp8"}]}, name="split_kda")
    with pytest.raises(RecipeError, match=r"k_proj.* read the same input"):
        quantize(model, recipe, verbose=False)


def test_probe_that_cannot_run_is_named() -> None:
    """Remote code whose forward fails on this machine (the real Kimi-K3 needs fla's GPU kernels): the
    error names the class and the cause."""
    import dataclasses

    import torch

    from modelopt_k3.quant.shared_inputs import ProbeError

    class Broken(torch.nn.Module):
        config = type("C", (), {"vocab_size": 8})()

        def forward(self, input_ids, use_cache):
            raise RuntimeError("Triton is required")

    class Config:
        def to_json_string(self, use_diff):
            return '{"broken": true}'

    spec = dataclasses.replace(SPEC, quant=dataclasses.replace(SPEC.quant, probe_model=lambda cls, config, device: (Broken(), "")))
    with pytest.raises(ProbeError, match=r"Broken's code .* RuntimeError: Triton is required"):
        discover_shared_inputs(spec, Broken, Config())
