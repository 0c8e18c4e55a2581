"""The spec registry: one spec per model_type (a second always refused), builtin model packages found by
listing models/ (private and non-package directories skipped)."""

from __future__ import annotations

import dataclasses
import importlib.util
import types

import pytest

from modelopt_k3.spec import (
    SpecError,
    builtin_model_packages,
    get_spec,
    register_spec,
    registry,
)


@pytest.fixture
def scratch_registry(monkeypatch):
    """The registry as it is, restored after the test (a test's registrations never leak)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    return registry._REGISTRY


def test_a_second_spec_for_a_model_type_is_refused(scratch_registry):
    base = get_spec("kimi_k3")
    first = register_spec(dataclasses.replace(base, model_type="mutation_test_model"))
    assert get_spec("mutation_test_model") is first
    second = dataclasses.replace(first, min_transformers="0.0.1")
    with pytest.raises(SpecError, match="a spec for model_type 'mutation_test_model' is already registered"):
        register_spec(second)
    assert get_spec("mutation_test_model") is first
    with pytest.raises(TypeError):  # no way to ask for a replacement
        register_spec(second, overwrite=True)


def test_builtin_packages_are_the_public_package_directories(tmp_path, monkeypatch):
    for name, is_package in (("alpha", True), ("_private", True), ("not_a_package", False)):
        (tmp_path / name).mkdir()
        if is_package:
            (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / "loose.py").write_text("")
    real = importlib.util.find_spec

    def find_spec(name, *a, **k):
        if name == registry.MODELS_PACKAGE:
            return types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
        return real(name, *a, **k)

    builtin_model_packages.cache_clear()
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    try:
        assert builtin_model_packages() == {"alpha": "modelopt_k3.models.alpha"}
    finally:
        monkeypatch.undo()
        builtin_model_packages.cache_clear()
    assert {"kimi_k3", "qwen3_moe", "gpt_oss"} <= set(builtin_model_packages())


def test_known_model_types_are_the_registered_and_the_builtin_ones(scratch_registry):
    """Both sets: a spec registered from outside (no package under models/) and builtins not imported yet."""
    register_spec(dataclasses.replace(get_spec("kimi_k3"), model_type="mutation_test_model"))
    scratch_registry.pop("gpt_oss", None)  # as if not imported yet: still known, from its package
    known = registry.known_model_types()
    assert {"mutation_test_model", "gpt_oss", "qwen3_moe", "kimi_k3"} <= set(known) and known == sorted(known)
