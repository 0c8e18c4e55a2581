"""Which tensors a checkpoint of a transformers-native MoE must store, read off the model built on meta.

The default ``SourceCheckSpec.expert_layout``/``dense_layout`` of ``transformers_moe_spec``: transformers' own
class, built from config.json on the meta device (no memory, no weights, no checkpoint code), says every
parameter's name and shape; the fused ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` of an experts
module is the checkpoint's per-expert ``gate_proj``/``up_proj [I, H]`` and ``down_proj [H, I]`` (transformers'
conversion, reversed). A model package whose errors should name the config fields behind a shape (Qwen3-MoE)
writes its own rules; a new model gets these.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

import torch
import transformers

from ...spec import ExpertsLayout

LAYER_RE = r"model\.layers\.(?P<layer>\d+)\."
Dense = tuple[tuple[str, tuple[int, ...] | None, str], ...]


def layer_re(layers: str = "model.layers") -> str:
    """Keys under decoder layer ``layer`` of ``layers`` (the source check bounds it by num_hidden_layers)."""
    return rf"{re.escape(layers)}\.(?P<layer>\d+)\."


def _frozen(config: Mapping[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, default=str)


@lru_cache(maxsize=4)
def _meta_shapes(model_class: str, config_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every persistent tensor of ``model_class`` built from the config on meta (cached by the
    config's JSON: the loader and the converter ask for both layouts of one config)."""
    cls = getattr(transformers, model_class)
    raw = {k: v for k, v in json.loads(config_json).items() if k != "quantization_config"}
    config = cls.config_class(**raw)
    config._experts_implementation = "eager"
    with torch.device("meta"):
        model = cls(config)
    return tuple((name, tuple(t.shape)) for name, t in model.state_dict().items())


def meta_layouts(model_class: str, fields: tuple[str, ...] = ("num_hidden_layers",),
                 experts_re: str = r"\.mlp\.experts$", layers: str = "model.layers") -> tuple[
        Callable[[Mapping[str, Any]], tuple[ExpertsLayout, ...]], Callable[[Mapping[str, Any]], Dense]]:
    """(expert_layout, dense_layout) for ``SourceCheckSpec``, both read off ``model_class`` built on meta; an error
    quotes the config ``fields`` that place the layers (the ones a user would edit)."""

    def text(config: Mapping[str, Any]) -> Mapping[str, Any]:  # a VLM's fields live in its text_config
        return config["text_config"] if isinstance(config.get("text_config"), Mapping) else config

    def quoted(config: Mapping[str, Any]) -> str:
        return f"{model_class} built from config.json: " + ", ".join(f"{k}={text(config).get(k)}" for k in fields)

    def experts(config: Mapping[str, Any]) -> dict[str, dict[str, tuple[int, ...]]]:
        found: dict[str, dict[str, tuple[int, ...]]] = {}
        for name, shape in _meta_shapes(model_class, _frozen(config)):
            module, _, param = name.rpartition(".")
            if re.search(experts_re, module) and param in ("gate_up_proj", "down_proj"):
                found.setdefault(module, {})[param] = shape
        return found

    def expert_layout(config: Mapping[str, Any]) -> tuple[ExpertsLayout, ...]:
        layouts = []
        for module, params in experts(config).items():
            e, two_i, h = params["gate_up_proj"]
            i = two_i // 2
            layouts.append(ExpertsLayout(module, e, {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)},
                                         f"{quoted(config)}; {module}.gate_up_proj {[e, two_i, h]}"))
        return tuple(layouts)

    def dense_layout(config: Mapping[str, Any]) -> Dense:
        fused = set(experts(config))
        shapes = _meta_shapes(model_class, _frozen(config))
        rules: list[tuple[str, tuple[int, ...] | None, str]] = [
            (re.escape(name), shape, quoted(config)) for name, shape in shapes if name.rpartition(".")[0] not in fused]
        rules.append((layer_re(layers), None, f"num_hidden_layers={text(config).get('num_hidden_layers')}"))
        return tuple(rules)

    return expert_layout, dense_layout
