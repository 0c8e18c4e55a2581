"""The spec registry: ``model_type`` -> ``ModelSpec``.

Builtin models are the packages under ``modelopt_k3/models/``, one per model, named after the
``model_type`` they register (``models/kimi_k3`` registers ``kimi_k3``). They are found by listing that
directory and imported only when their model type is asked for, so importing the tools stays cheap and
adding a model edits no list here. The package's spec is the whole contract: everything else a consumer
needs of the model (serving rules, checkpoint view, conversion mapping, stand-in) is a field of it, so
nothing looks for any other module by its name. A model type registers once; a second registration is
an error, never a silent replacement.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache
from pathlib import Path

from .contract import ModelSpec, SpecError

MODELS_PACKAGE = "modelopt_k3.models"
# Packages under ``models/`` that are no model type: code the model packages share (``models/common``).
SHARED_PACKAGES = frozenset({"common"})

_REGISTRY: dict[str, ModelSpec] = {}


@cache
def builtin_model_packages() -> dict[str, str]:
    """model_type -> the module name of its builtin package (listed, not imported)."""
    found = importlib.util.find_spec(MODELS_PACKAGE)
    if found is None or not found.submodule_search_locations:
        return {}
    return {
        d.name: f"{MODELS_PACKAGE}.{d.name}"
        for root in found.submodule_search_locations
        for d in sorted(Path(root).iterdir())
        if d.is_dir() and (d / "__init__.py").is_file() and not d.name.startswith("_")
        and d.name not in SHARED_PACKAGES
    }


def register_spec(spec: ModelSpec) -> ModelSpec:
    """Register ``spec`` under its ``model_type``; SpecError if that model type already has one."""
    if spec.model_type in _REGISTRY:
        raise SpecError(f"a spec for model_type {spec.model_type!r} is already registered "
                        f"({_REGISTRY[spec.model_type].loading.prepare.__module__}); a model type registers once")
    _REGISTRY[spec.model_type] = spec
    return spec


def known_model_types() -> list[str]:
    return sorted(set(_REGISTRY) | set(builtin_model_packages()))


def get_spec(model_type: str) -> ModelSpec:
    if model_type not in _REGISTRY:
        module = builtin_model_packages().get(model_type)
        if module is not None:
            importlib.import_module(module)
    try:
        return _REGISTRY[model_type]
    except KeyError:
        raise SpecError(f"no model spec for model_type {model_type!r}; known: {known_model_types()}") from None
