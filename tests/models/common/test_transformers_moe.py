"""``models/common``: the experts class derived from transformers' experts interface, our experts base on its
instances with transformers' eager numerics bit for bit (also for a model no package of ours defines yet:
MiniMax-M2, issue 40), and the spec builder's derived fields."""

from __future__ import annotations

import re

import pytest
import torch

from modelopt_k3.models.common.experts import experts_placer, fused_experts_class
from modelopt_k3.models.common.spec import experts_class, transformers_conversion, transformers_moe_spec
from modelopt_k3.spec import SpecError

SMALL = {"hidden_size": 16, "intermediate_size": 8, "moe_intermediate_size": 8, "num_experts": 6,
         "n_routed_experts": 6, "num_local_experts": 6}


@pytest.mark.parametrize("model_class, name", [("Qwen3MoeForCausalLM", "Qwen3MoeExperts"),
                                               ("DeepseekV3ForCausalLM", "DeepseekV3Experts"),
                                               ("MiniMaxM2ForCausalLM", "MiniMaxM2Experts")])
def test_the_experts_class_is_the_one_the_experts_interface_decorates(model_class, name):
    assert experts_class(model_class).__name__ == name


def test_a_modeling_module_without_one_experts_class_is_refused():
    with pytest.raises(SpecError, match="experts-interface classes, not one"):
        experts_class("LlamaForCausalLM")


def _experts(model_class: str) -> torch.nn.Module:
    import transformers

    config_cls = getattr(transformers, model_class).config_class
    config = config_cls(**{k: v for k, v in SMALL.items() if hasattr(config_cls(), k)})
    config._experts_implementation = "eager"
    with torch.device("cpu"):
        module = experts_class(model_class)(config).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module


@pytest.mark.parametrize("model_class", ["Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "MiniMaxM2ForCausalLM"])
def test_the_fused_experts_give_transformers_eager_output_bit_for_bit(model_class):
    module = _experts(model_class)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 16, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(40)])  # k = 3: the add order shows
    weights = torch.rand(40, 3, generator=g)
    want = module(hidden, ids, weights)
    base = type(module)
    root = torch.nn.Sequential(module)
    from modelopt_k3.dist.placement import ExpertPlacement

    experts_placer(base)(root, ExpertPlacement(6))
    assert type(module) is fused_experts_class(base) and base.__name__.replace("Experts", "FusedExperts") == \
        type(module).__name__
    assert base.forward is not type(module).forward  # transformers' class itself is left unpatched
    got = module(hidden, ids, weights)
    assert torch.equal(got, want)


def test_one_fused_class_per_transformers_class():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from modelopt_k3.models.qwen3_moe import Qwen3MoeFusedExperts

    assert fused_experts_class(Qwen3MoeExperts) is Qwen3MoeFusedExperts


def test_the_builder_derives_the_conversion_and_the_experts():
    spec = transformers_moe_spec("minimax_m2", "MiniMaxM2ForCausalLM", num_experts_attr="num_local_experts")
    assert spec.loading.model_class.name == "MiniMaxM2ForCausalLM" and spec.experts.num_experts_attr == "num_local_experts"
    assert [(c.source_patterns, c.target_patterns) for c in spec.loading.converters(None)] == \
        [(c.source_patterns, c.target_patterns) for c in transformers_conversion("minimax_m2")]
    assert spec.quant.shared_scale_groups == (("gate_proj", "up_proj"),)
    with pytest.raises(SpecError, match="no checkpoint conversion for 'llama'"):
        transformers_conversion("llama")


@pytest.mark.parametrize("sizes", [{}, {"mlp_only_layers": [], "decoder_sparse_step": 2}], ids=["stand-in", "step-2"])
def test_the_layout_read_off_the_meta_model_is_the_stand_ins(sizes, tmp_path):
    """Every tensor the Qwen3-MoE stand-in generator (its own code, not transformers') writes has the shape the
    meta model's layout gives it, and every expert layer it names is stored, expert by expert."""
    import json

    from modelopt_k3.checkpoint import CheckpointReader
    from modelopt_k3.models.common.layout import meta_layouts
    from modelopt_k3.testing import make_tiny

    ckpt = make_tiny("qwen3_moe", tmp_path / "ckpt", seed=0, **sizes)
    config = json.loads((ckpt / "config.json").read_text())
    expert_layout, dense_layout = meta_layouts("Qwen3MoeForCausalLM")
    layouts = {x.module: x for x in expert_layout(config)}
    rules = [(re.compile(rx), shape) for rx, shape, _ in dense_layout(config) if shape is not None]
    expert_key = re.compile(r"^(?P<module>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
    stored: dict[str, set[int]] = {}
    with CheckpointReader(ckpt) as reader:
        for key, (_, shape) in reader.inventory().items():
            m = expert_key.match(key)
            if m:
                assert tuple(shape) == layouts[m["module"]].projections[m["proj"]], key
                stored.setdefault(m["module"], set()).add(int(m["e"]))
            else:
                assert [want for rx, want in rules if rx.fullmatch(key)] == [tuple(shape)], key
    assert stored == {name: set(range(x.num_experts)) for name, x in layouts.items()} and len(stored) >= 1


def test_a_new_model_gets_a_source_layout_from_its_classes():
    """MiniMax-M2 (issue 40): no package of ours, yet the builder's spec knows its experts' checkpoint shapes."""
    spec = transformers_moe_spec("minimax_m2", "MiniMaxM2ForCausalLM", num_experts_attr="num_local_experts")
    config = {"model_type": "minimax_m2", "hidden_size": 16, "intermediate_size": 8, "num_local_experts": 4,
              "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 8, "vocab_size": 32}
    layouts = spec.source_check.expert_layout(config)
    assert [(x.module, x.num_experts, dict(x.projections)) for x in layouts] == [
        (f"model.layers.{i}.mlp.experts", 4, {"gate_proj": (8, 16), "up_proj": (8, 16), "down_proj": (16, 8)})
        for i in range(2)]
    assert ("model\\.embed_tokens\\.weight", (32, 16)) in [r[:2] for r in spec.source_check.dense_layout(config)]


QWEN3 = {("model.layers.*.self_attn", ("k_proj", "q_proj", "v_proj")), ("model.layers.*.mlp", ("gate_proj", "up_proj"))}
MLA = {("model.layers.*.self_attn", ("kv_a_proj_with_mqa", "q_a_proj")), ("model.layers.*.mlp", ("gate_proj", "up_proj")),
       ("model.layers.*.mlp.shared_experts", ("gate_proj", "up_proj"))}


@pytest.mark.parametrize("model_type, sizes, rules", [
    ("qwen3_moe", {}, QWEN3),  # the stand-in: one dense mlp_only_layers layer
    ("qwen3_moe", {"num_hidden_layers": 48, "mlp_only_layers": [], "num_experts": 128, "hidden_size": 2048},
     QWEN3 - {("model.layers.*.mlp", ("gate_proj", "up_proj"))}),  # Qwen3-30B-A3B's shape: no dense MLP
    ("qwen3_moe", {"num_experts": 0}, QWEN3),  # a dense model of the family stays dense
    ("deepseek_v3", {}, MLA),
    ("deepseek_v3", {"num_hidden_layers": 61, "first_k_dense_replace": 3, "n_routed_experts": 256, "n_group": 8,
                     "topk_group": 4, "kv_lora_rank": 512, "q_lora_rank": 1536}, MLA),
    ("deepseek_v3", {"first_k_dense_replace": 0}, MLA - {("model.layers.*.mlp", ("gate_proj", "up_proj"))}),
    ("gpt_oss", {}, {("model.layers.*.self_attn", ("k_proj", "q_proj", "v_proj"))}),  # sliding and full layers
    ("minimax_m2", {}, {("model.layers.*.self_attn", ("k_proj", "q_proj", "v_proj"))}),  # hub names, all MoE
    # GLM-5: the DSA indexer reads what MLA reads (wq_b the q latent, wk/weights_proj the hidden states).
    ("glm_moe_dsa", {}, (MLA - {("model.layers.*.self_attn", ("kv_a_proj_with_mqa", "q_a_proj"))})
     | {("model.layers.*.self_attn", ("indexer.wq_b", "q_b_proj")),
        ("model.layers.*.self_attn", ("indexer.weights_proj", "indexer.wk", "kv_a_proj_with_mqa", "q_a_proj"))}),
], ids=["qwen3-stand-in", "qwen3-all-moe", "qwen3-dense", "dsv3-stand-in", "dsv3-real-shape", "dsv3-all-moe",
        "gpt-oss", "minimax-m2", "glm-5"])
def test_the_default_probe_finds_every_layer_kinds_groups(model_type, sizes, rules, tmp_path, monkeypatch):
    """Every layer kept (tiny widths) is every layer kind as the real config places it: MLA's q_a + kv_a, attention
    q/k/v, dense and shared-expert gate/up -- and no group of a kind the config does not have."""
    from transformers import AutoConfig

    from modelopt_k3.quant import shared_inputs
    from modelopt_k3.spec import get_spec
    from modelopt_k3.testing import make_tiny

    spec = get_spec(model_type)
    stand_in = AutoConfig.from_pretrained(make_tiny(model_type, tmp_path / "ckpt", seed=0))
    config = type(stand_in)(**{**stand_in.to_dict(), **sizes})
    model_cls = spec.loading.model_class.resolve(tmp_path / "ckpt", {}, False)[0]
    monkeypatch.setattr(shared_inputs, "_DISCOVERED", {})
    found = shared_inputs.discover_shared_inputs(spec, model_cls, config)
    assert {(r.parent, r.members) for r in found} == rules
