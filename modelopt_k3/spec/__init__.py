"""The model-spec contract (the bottom layer: imports nothing else of ``modelopt_k3``).

``contract``: ``ModelSpec`` and its groups, one per consumer; ``kv_cache``: where a model's KV cache is;
``conversion``: running transformers ``WeightConverter`` chains (and ``DecodeOp``, the decode step a
model's converters declare); ``registry``: ``model_type`` -> spec, builtin models found lazily under
``models/``. See docs/ARCHITECTURE.md "Model specs".
"""

from .contract import (
    CarriedModules,
    ExpertProjection,
    ExpertsLayout,
    ExpertsSpec,
    ExportSpec,
    LoadingSpec,
    ManifestNaming,
    MemorySpec,
    ModelClassSource,
    ModelSpec,
    PrepareContext,
    QuantSpec,
    RecipesSpec,
    RemoteCodeClass,
    ReportSpec,
    ServingSpec,
    SourceCheckSpec,
    SpecError,
    TransformersClass,
)
from .kv_cache import CachedOutput, KvCacheSite
from .registry import builtin_model_packages, get_spec, known_model_types, register_spec

__all__ = [
    "CachedOutput",
    "ExpertProjection",
    "ExpertsLayout",
    "ExpertsSpec",
    "ExportSpec",
    "KvCacheSite",
    "LoadingSpec",
    "ManifestNaming",
    "MemorySpec",
    "ModelClassSource",
    "ModelSpec",
    "PrepareContext",
    "QuantSpec",
    "RecipesSpec",
    "RemoteCodeClass",
    "ReportSpec",
    "ServingSpec",
    "SourceCheckSpec",
    "CarriedModules",
    "SpecError",
    "TransformersClass",
    "builtin_model_packages",
    "get_spec",
    "known_model_types",
    "register_spec",
]
