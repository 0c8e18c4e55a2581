"""Serving engines whose checkpoint loading ``modelopt-k3-check`` replays, and per-model rules.

An engine's generic ModelOpt code is replayed by a ``ModelOptEngine`` (``vllm.py``, ``sglang.py``);
what the engine's class for one model type does (fused parameters, layers it builds unquantized,
name rewrites, KV-cache handling) is a ``ModelServing`` that the model's spec declares
(``ServingSpec.rules``, built in ``models/<model>/serving.py``). An engine whose model class we replay
whole (TensorRT-LLM's Kimi-K3 loader) is given a replay function instead.
"""

from __future__ import annotations

from collections.abc import Callable

from ...spec import ServingSpec, SpecError, get_spec
from ..layout import Layout
from ..report import EngineResult, Refusal
from .base import ModelOptEngine, ModelServing
from .sglang import SGLANG
from .vllm import VLLM

ENGINE_NAMES = ("vllm", "sglang", "trtllm")
MODELOPT_ENGINES: dict[str, ModelOptEngine] = {"vllm": VLLM, "sglang": SGLANG}
Replay = Callable[..., EngineResult]


def serving_spec(model_type: str) -> ServingSpec:
    """The model's serving declarations (none for a model type without a spec)."""
    try:
        return get_spec(model_type).serving
    except SpecError:
        return ServingSpec()


def serving_rules(model_type: str, engine: str, serving: ServingSpec | None = None) -> ModelServing | Replay | None:
    """What ``engine``'s class for ``model_type`` does when it loads an export (None: no rules known).
    ``serving``: the model's declarations when the caller holds its spec (else looked up by ``model_type``)."""
    rules = (serving or serving_spec(model_type)).rules
    return rules().get(engine) if rules is not None else None


def kv_scale_names(config: dict, serving: ServingSpec | None = None) -> list[str]:
    """The KV-cache scale tensors an export of a model with this config holds (none if unknown)."""
    names = (serving or serving_spec(str(config.get("model_type", "")))).kv_scale_names
    return names(config) if names else []


def parse_engines(engines: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``"vllm,sglang"`` or a sequence -> validated names (a ``ValueError`` names the unknown one)."""
    names = [e.strip() for e in (engines.split(",") if isinstance(engines, str) else engines) if e.strip()]
    unknown = [e for e in names if e not in ENGINE_NAMES]
    if unknown or not names:
        raise ValueError(f"unknown serving engine(s) {unknown or names!r}; choose from {', '.join(ENGINE_NAMES)}")
    return tuple(dict.fromkeys(names))


def replay(engine: str, layout: Layout, *, numerics: bool = True, serving: ServingSpec | None = None) -> EngineResult:
    """What ``engine`` does when it loads ``layout`` (``serving``: as in ``serving_rules``)."""
    model_type = str(layout.config.get("model_type", ""))
    rules = serving_rules(model_type, engine, serving)
    if rules is None:
        result = EngineResult(engine)
        result.refusals.append(Refusal("config.json", f"modelopt-k3-check knows no {engine} loading rules for "
                                                      f"model_type {model_type!r}"))
        return result
    if isinstance(rules, ModelServing):
        return MODELOPT_ENGINES[engine].replay(layout, rules, numerics=numerics)
    return rules(layout, numerics=numerics)
