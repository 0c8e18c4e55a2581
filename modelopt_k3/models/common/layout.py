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
from .lazy import ClassRef, resolve_class


def layer_re(layers: str = "model.layers") -> str:
    """Keys under decoder layer ``layer`` of ``layers`` (the source check bounds it by num_hidden_layers)."""
    return rf"{re.escape(layers)}\.(?P<layer>\d+)\."


LAYER_RE = layer_re()
# A fused experts parameter of the built model -> the checkpoint's per-expert projections its rows hold, in order.
GATED_FUSION = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
Dense = tuple[tuple[str, tuple[int, ...] | None, str], ...]


def _frozen(config: Mapping[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, default=str)


@lru_cache(maxsize=4)
def _meta_shapes(model_class: str | ClassRef, config_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every persistent tensor of ``model_class`` (transformers' class by name, or a package's
    subclass of it) built from the config on meta (cached by the config's JSON: the loader and the converter ask
    for both layouts of one config)."""
    cls = getattr(transformers, model_class) if isinstance(model_class, str) else resolve_class(model_class)
    raw = {k: v for k, v in json.loads(config_json).items() if k != "quantization_config"}
    config = cls.config_class(**raw)
    config._experts_implementation = "eager"
    with torch.device("meta"):
        model = cls(config)
    return tuple((name, tuple(t.shape)) for name, t in model.state_dict().items())


def meta_tensor_shapes(model_class: str | ClassRef, config: Mapping[str, Any]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every persistent tensor of transformers' ``model_class`` built from ``config`` on meta."""
    return _meta_shapes(model_class, _frozen(config))


def _same_name(name: str) -> str:
    return name


def meta_layouts(model_class: str | ClassRef, fields: tuple[str, ...] = ("num_hidden_layers",),
                 experts_re: str = r"\.mlp\.experts$", *, fusion: Mapping[str, tuple[str, ...]] = GATED_FUSION,
                 checkpoint_name: Callable[[str], str] = _same_name, layer_re: str = LAYER_RE) -> tuple[
        Callable[[Mapping[str, Any]], tuple[ExpertsLayout, ...]], Callable[[Mapping[str, Any]], Dense]]:
    """(expert_layout, dense_layout) for ``SourceCheckSpec``, both read off ``model_class`` built on meta; an error
    quotes the config ``fields`` that place the layers (the ones a user would edit).

    ``fusion``: each fused experts parameter of transformers' class -> the checkpoint projections stacked in its
    rows (a non-gated model: ``{"up_proj": ("up_proj",), ...}``); ``checkpoint_name``: transformers' name -> the
    checkpoint's (a hub prefix transformers renames, e.g. Nemotron-H's ``backbone.``); ``layer_re``: a decoder
    layer's checkpoint keys, group ``layer``. ``model_class``: transformers' class by name, or a package's subclass
    of it (MiniMax-M2's, which keeps the hub's ``block_sparse_moe``; its ``fusion`` names Mixtral's ``w1``/``w3``/``w2``),
    or a function giving that subclass: nothing is imported or built until the returned functions are called."""

    def shown() -> str:
        return model_class if isinstance(model_class, str) else resolve_class(model_class).__name__

    def text(config: Mapping[str, Any]) -> Mapping[str, Any]:  # a VLM's fields live in its text_config
        return config["text_config"] if isinstance(config.get("text_config"), Mapping) else config

    def quoted(config: Mapping[str, Any]) -> str:
        return f"{shown()} built from config.json: " + ", ".join(f"{k}={text(config).get(k)}" for k in fields)

    def experts(config: Mapping[str, Any]) -> dict[str, dict[str, tuple[int, ...]]]:
        found: dict[str, dict[str, tuple[int, ...]]] = {}
        for name, shape in _meta_shapes(model_class, _frozen(config)):
            module, _, param = checkpoint_name(name).rpartition(".")
            if re.search(experts_re, module) and param in fusion:
                found.setdefault(module, {})[param] = shape
        return found

    def expert_layout(config: Mapping[str, Any]) -> tuple[ExpertsLayout, ...]:
        layouts = []
        for module, params in experts(config).items():
            projections: dict[str, tuple[int, int]] = {}
            for param, projs in fusion.items():
                e, rows, cols = params[param]
                projections.update((proj, (rows // len(projs), cols)) for proj in projs)
            first = next(iter(fusion))
            layouts.append(ExpertsLayout(module, params[first][0], projections,
                                         f"{quoted(config)}; {module}.{first} {list(params[first])}"))
        return tuple(layouts)

    def dense_layout(config: Mapping[str, Any]) -> Dense:
        fused = set(experts(config))
        shapes = _meta_shapes(model_class, _frozen(config))
        rules: list[tuple[str, tuple[int, ...] | None, str]] = [
            (re.escape(name), shape, quoted(config)) for name, shape in ((checkpoint_name(n), s) for n, s in shapes)
            if name.rpartition(".")[0] not in fused]
        rules.append((layer_re, None, f"num_hidden_layers={text(config).get('num_hidden_layers')}"))
        return tuple(rules)

    return expert_layout, dense_layout
