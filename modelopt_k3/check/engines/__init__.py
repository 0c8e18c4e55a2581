"""Serving engines whose checkpoint loading ``modelopt-k3-check`` replays, and per-model rules.

An engine's generic ModelOpt code is replayed by a ``ModelOptEngine`` (``vllm.py``, ``sglang.py``);
what the engine's class for one model type does (fused parameters, layers it builds unquantized,
name rewrites, KV-cache handling) is a ``ModelServing`` registered by the model's package
(``models/<model>/serving.py``). An engine whose model class we replay whole (TensorRT-LLM's
Kimi-K3 loader) registers a replay function instead.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ...spec import builtin_module
from ..layout import Layout
from ..report import EngineResult, Refusal
from .base import ModelOptEngine, ModelServing
from .sglang import SGLANG
from .vllm import VLLM

ENGINE_NAMES = ("vllm", "sglang", "trtllm")
MODELOPT_ENGINES: dict[str, ModelOptEngine] = {"vllm": VLLM, "sglang": SGLANG}
Replay = Callable[..., EngineResult]

_SERVING: dict[tuple[str, str], ModelServing | Replay] = {}
# model_type -> config -> the KV-cache scale tensors an export with a KV-cache format holds.
_KV_SCALE_NAMES: dict[str, Callable[[dict], list[str]]] = {}


def register_serving(model_type: str, engine: str, rules: ModelServing | Replay) -> None:
    if engine not in ENGINE_NAMES:
        raise ValueError(f"unknown engine {engine!r}; known: {list(ENGINE_NAMES)}")
    _SERVING[(model_type, engine)] = rules


def register_kv_scale_names(model_type: str, names: Callable[[dict], list[str]]) -> None:
    _KV_SCALE_NAMES[model_type] = names


def _load_builtin(model_type: str) -> None:
    """Import the builtin model package's ``serving`` module, which registers its rules (lazy, like the specs)."""
    module = builtin_module(model_type, "serving")
    if module is not None:
        importlib.import_module(module)


def serving_rules(model_type: str, engine: str) -> ModelServing | Replay | None:
    if (model_type, engine) not in _SERVING:
        _load_builtin(model_type)
    return _SERVING.get((model_type, engine))


def kv_scale_names(config: dict) -> list[str]:
    """The KV-cache scale tensors an export of a model with this config holds (none if unknown)."""
    model_type = str(config.get("model_type", ""))
    if model_type not in _KV_SCALE_NAMES:
        _load_builtin(model_type)
    names = _KV_SCALE_NAMES.get(model_type)
    return names(config) if names else []


def parse_engines(engines: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``"vllm,sglang"`` or a sequence -> validated names (a ``ValueError`` names the unknown one)."""
    names = [e.strip() for e in (engines.split(",") if isinstance(engines, str) else engines) if e.strip()]
    unknown = [e for e in names if e not in ENGINE_NAMES]
    if unknown or not names:
        raise ValueError(f"unknown serving engine(s) {unknown or names!r}; choose from {', '.join(ENGINE_NAMES)}")
    return tuple(dict.fromkeys(names))


def replay(engine: str, layout: Layout, *, numerics: bool = True) -> EngineResult:
    """What ``engine`` does when it loads ``layout``."""
    model_type = str(layout.config.get("model_type", ""))
    rules = serving_rules(model_type, engine)
    if rules is None:
        result = EngineResult(engine)
        result.refusals.append(Refusal("config.json", f"modelopt-k3-check knows no {engine} loading rules for "
                                                      f"model_type {model_type!r}"))
        return result
    if isinstance(rules, ModelServing):
        return MODELOPT_ENGINES[engine].replay(layout, rules, numerics=numerics)
    return rules(layout, numerics=numerics)
