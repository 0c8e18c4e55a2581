"""The spec contract is the bottom layer, and a spec (not the loader) says where the model class comes from."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from modelopt_k3.spec import RemoteCodeClass, SpecError, TransformersClass, builtin_model_packages, get_spec

SPEC_DIR = Path(__file__).resolve().parents[2] / "modelopt_k3" / "spec"


def _package_imports(path: Path) -> list[str]:
    """Every modelopt_k3 module a file imports (relative imports resolved against ``modelopt_k3.spec``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ["modelopt_k3", "spec"][: 2 - (node.level - 1)]
                found.append(".".join([*base, *([node.module] if node.module else [])]))
            elif node.module and node.module.startswith("modelopt_k3"):
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("modelopt_k3")]
    return found


def test_the_contract_imports_nothing_above_it():
    upward = {
        f"{path.name}: {mod}"
        for path in SPEC_DIR.glob("*.py")
        for mod in _package_imports(path)
        if not (mod == "modelopt_k3.spec" or mod.startswith("modelopt_k3.spec."))
    }
    assert not upward, f"modelopt_k3/spec must import nothing else of modelopt_k3: {sorted(upward)}"


def test_builtin_models_are_the_model_packages():
    assert builtin_model_packages()["kimi_k3"] == "modelopt_k3.models.kimi_k3"
    assert get_spec("kimi_k3").loading.model_class == RemoteCodeClass()
    with pytest.raises(SpecError, match=r"no model spec for model_type 'nope'; known: \[.*'kimi_k3'"):
        get_spec("nope")


def test_transformers_class_needs_no_remote_code(tmp_path):
    # transformers' own class: resolved from transformers, the config by its own config class, and no
    # trust_remote_code asked for (the loader passes False and it still resolves).
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    Qwen3MoeConfig(num_hidden_layers=1, hidden_size=16, num_experts=4).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    cls, config = TransformersClass("Qwen3MoeForCausalLM").resolve(tmp_path, raw, trust_remote_code=False)
    assert cls is Qwen3MoeForCausalLM and isinstance(config, Qwen3MoeConfig) and config.num_experts == 4
    with pytest.raises(SpecError, match="has no class 'NoSuchForCausalLM'"):
        TransformersClass("NoSuchForCausalLM").resolve(tmp_path, raw, trust_remote_code=False)


def test_remote_code_class_is_opt_in(tmp_path):
    raw = {"auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}
    with pytest.raises(SpecError, match=r"ships its own modeling code \(modeling_x.XForCausalLM\).*--trust_remote_code"):
        RemoteCodeClass().resolve(tmp_path, raw, trust_remote_code=False)
    with pytest.raises(SpecError, match="no auto_map entry for AutoModelForCausalLM/AutoModel"):
        RemoteCodeClass().resolve(tmp_path, {}, trust_remote_code=True)
