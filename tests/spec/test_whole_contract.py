"""The spec is the whole contract (issue 27): serving rules, checkpoint view, conversion mapping and the tiny
stand-in are fields of the model's ``ModelSpec``; a model type registers once; nothing is found by file name."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from modelopt_k3.check.engines import ENGINE_NAMES, kv_scale_names, serving_rules
from modelopt_k3.check.engines.base import ModelServing
from modelopt_k3.spec import ServingSpec, SpecError, builtin_model_packages, get_spec, register_spec
from modelopt_k3.testing import make_tiny

PACKAGE = Path(__file__).resolve().parents[2] / "modelopt_k3"
MODELS = sorted(builtin_model_packages())


def test_the_builtin_models_are_found():
    # Every package under models/ but the shared one (models/common) is a model type that registers its spec.
    dirs = {d.name for d in (PACKAGE / "models").iterdir() if (d / "__init__.py").is_file()}
    assert sorted(dirs - {"common"}) == MODELS and len(MODELS) >= 4
    assert all(get_spec(m).model_type == m for m in MODELS)


def test_registering_a_model_type_twice_is_an_error():
    spec = get_spec("qwen3_moe")
    with pytest.raises(SpecError, match=r"a spec for model_type 'qwen3_moe' is already registered.*registers once"):
        register_spec(spec)
    with pytest.raises(SpecError, match="already registered"):  # another spec under the same name: same
        register_spec(dataclasses.replace(spec, min_transformers="0.0.1"))
    assert get_spec("qwen3_moe") is spec  # the first one stays
    with pytest.raises(TypeError):  # there is no way to ask for a silent replacement
        register_spec(spec, overwrite=True)


def test_a_new_model_type_registers_once(monkeypatch):
    from modelopt_k3.spec import registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    new = dataclasses.replace(get_spec("qwen3_moe"), model_type="qwen3_moe_copy")
    assert register_spec(new) is new and get_spec("qwen3_moe_copy") is new
    with pytest.raises(SpecError, match="already registered"):
        register_spec(new)


# Every registered model declares its engines' rules (DeepSeek-V3's since i32s); one without them would be
# listed here, and the check says it knows no rules for it.
WITHOUT_SERVING_RULES: list[str] = []


def test_only_the_listed_models_lack_serving_rules():
    assert [m for m in MODELS if get_spec(m).serving.rules is None] == WITHOUT_SERVING_RULES
    assert all(serving_rules(m, e) is None for m in WITHOUT_SERVING_RULES for e in ENGINE_NAMES)


@pytest.mark.parametrize("model_type", [m for m in MODELS if m not in WITHOUT_SERVING_RULES])
def test_every_engine_rule_comes_from_the_spec(model_type):
    rules = get_spec(model_type).serving.rules()
    assert set(rules) == set(ENGINE_NAMES), f"{model_type}: rules for {sorted(rules)}"
    for engine in ENGINE_NAMES:
        assert serving_rules(model_type, engine) is rules[engine]
        assert isinstance(rules[engine], ModelServing) or callable(rules[engine])


def test_serving_rules_follow_the_spec_not_a_module_name(monkeypatch):
    # A spec's rules are what the check replays: swap them on the spec and the check follows.
    from modelopt_k3.spec import registry

    spec = get_spec("qwen3_moe")
    marker = object()
    monkeypatch.setitem(registry._REGISTRY, "qwen3_moe",
                        dataclasses.replace(spec, serving=ServingSpec(rules=lambda: {"vllm": marker})))
    assert serving_rules("qwen3_moe", "vllm") is marker
    assert serving_rules("qwen3_moe", "sglang") is None
    assert serving_rules("no_such_model", "vllm") is None


def test_kv_scale_names_come_from_the_spec():
    config = {"model_type": "kimi_k3", "text_config": {"num_hidden_layers": 3,
                                                       "linear_attn_config": {"kda_layers": [1, 3]}}}
    assert kv_scale_names(config) == ["language_model.model.layers.1.self_attn.k_proj.k_scale",
                                      "language_model.model.layers.1.self_attn.v_proj.v_scale"]
    assert kv_scale_names({"model_type": "qwen3_moe"}) == [] == kv_scale_names({"model_type": "nope"})


def test_the_checkpoint_view_and_the_converters_are_spec_fields():
    from modelopt_k3.models.deepseek_v3.prepare import checkpoint_converters as deepseek_converters
    from modelopt_k3.models.gpt_oss.model import checkpoint_converters as gpt_oss_converters
    from modelopt_k3.models.gpt_oss.model import per_expert_view
    from modelopt_k3.models.kimi_k3.prepare import checkpoint_converters as kimi_converters

    assert get_spec("gpt_oss").loading.checkpoint_view is per_expert_view
    assert get_spec("kimi_k3").loading.checkpoint_view is None is get_spec("qwen3_moe").loading.checkpoint_view
    assert get_spec("kimi_k3").loading.converters is kimi_converters
    assert get_spec("deepseek_v3").loading.converters is deepseek_converters
    assert get_spec("gpt_oss").loading.converters is gpt_oss_converters


def test_the_gpt_oss_reader_shows_the_view(tmp_path):
    # The reader applies the spec's view (GPT-OSS: fused [E, ...] MXFP4 blocks as per-expert tensors).
    from modelopt_k3.checkpoint import CheckpointReader

    ckpt = make_tiny("gpt_oss", tmp_path / "ckpt", seed=0)
    with CheckpointReader(ckpt) as reader:
        keys = set(reader.inventory())
    assert any(k.endswith(".experts.0.gate_up_proj.weight_packed") for k in keys), sorted(keys)[:20]
    assert not any(k.endswith("gate_up_proj_blocks") for k in keys)


@pytest.mark.parametrize("model_type", MODELS)
def test_make_tiny_writes_the_specs_stand_in(tmp_path, model_type):
    ckpt = make_tiny(model_type, tmp_path / "ckpt", seed=0)
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == model_type


def test_every_builtin_model_has_a_stand_in():
    assert all(callable(get_spec(m).stand_in) for m in MODELS)
    with pytest.raises(SpecError, match="no model spec for model_type 'nope'"):
        make_tiny("nope", "/nonexistent")


def test_nothing_is_found_by_its_file_name():
    # The spec package of a model type is the one lazy import (registry.get_spec); no other module of the
    # package imports a module by a computed name, and no registry outside the spec's remains.
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("testing/remote_code/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                first = node.args[0] if node.args else None
                third_party = (isinstance(first, ast.Constant) and isinstance(first.value, str)
                               and not first.value.startswith(("modelopt_k3", ".")))
                if (name in {"import_module", "find_spec"} and not third_party) or name in {
                        "register_checkpoint_view", "register_serving", "register_checkpoint_conversion_mapping",
                        "register_kv_scale_names"}:
                    offenders.append(f"{rel}:{node.lineno} {name}")
            if isinstance(node, ast.keyword) and node.arg == "overwrite" and rel.startswith(("spec/", "models/")):
                offenders.append(f"{rel}:{node.value.lineno} overwrite=")
    allowed = {
        "__init__.py": {"import_module"},  # the package's lazy public API (a fixed table of names)
        "quant/__init__.py": {"import_module"},  # quant's lazy public API (a fixed table of names)
        "spec/registry.py": {"import_module", "find_spec"},  # models/<model_type>: the one lookup
        "models/kimi_k3/shims.py": {"import_module"},  # transformers' modules the hub's remote code imports
        # A spec's classes, imported when a model is built: each call site names its module (no lookup by file name).
        "models/common/lazy.py": {"import_module"},
        # The conformance harness imports each engine's own modules from its side venv (it leaves the library).
        "check/conformance/drivers/_common.py": {"import_module", "find_spec"},
    }
    unexpected = [o for o in offenders
                  if o.rsplit(" ", 1)[1] not in allowed.get(o.split(":", 1)[0], set())]
    assert not unexpected, unexpected
