"""MTP layers stored as extra decoder layers that transformers does not build (DeepSeek-V3, GLM-5): the tensors
they hold, read off transformers' own decoder layer for that index built on meta, and ``SourceCheckSpec.carried``.

A checkpoint with ``num_nextn_predict_layers`` MTP layers stores each as ``model.layers.{num_hidden_layers + j}``:
a full decoder layer (routed experts per expert, as checkpoints store them) plus the MTP's own modules
(``extras``: name -> shape from (hidden_size, vocab_size); DeepSeek-V3 stores a layer-local embedding and head,
GLM-5 shares the model's). Every export carries them unquantized (``CarriedModules``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...spec import CarriedModules
from ...spec.config import positive_int
from .lazy import ClassRef, resolve_class

Extras = Mapping[str, Callable[[int, int], tuple[int, ...]]]
MTP_REASON = "MTP layer (not built by transformers; carried unquantized)"


def mtp_layer_shapes(decoder_layer: ClassRef, config_class: ClassRef, config: Mapping[str, Any], layer: int,
                     extras: Extras) -> dict[str, tuple[int, ...]]:
    """The logical tensors of MTP layer ``layer`` (``model.layers.{layer}``) and their shapes, in module order:
    transformers' ``decoder_layer`` of ``config_class`` (either may be a function giving it: ``lazy.py``) for that
    index, built on meta, then ``extras``."""
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "quantization_config")}
    cfg = resolve_class(config_class)(**{**fields, "num_hidden_layers": layer + 1})
    with torch.device("meta"):
        decoder = resolve_class(decoder_layer)(cfg, layer)
    prefix = f"model.layers.{layer}"
    out: dict[str, tuple[int, ...]] = {}
    tensors = [*decoder.named_parameters(),
               *((f"{m}.{n}" if m else n, b) for m, mod in decoder.named_modules()
                 for n, b in mod.named_buffers(recurse=False) if n not in mod._non_persistent_buffers_set)]
    for name, t in tensors:
        head, _, param = name.rpartition(".")
        if head.endswith("mlp.experts") and param in ("gate_up_proj", "down_proj"):
            num, rows, cols = t.shape
            projs = ("gate_proj", "up_proj") if param == "gate_up_proj" else ("down_proj",)
            out.update((f"{prefix}.{head}.{e}.{proj}.weight", (rows // len(projs), cols))
                       for e in range(num) for proj in projs)
        else:
            out[f"{prefix}.{name}"] = tuple(t.shape)
    h, v = positive_int(config, "hidden_size"), positive_int(config, "vocab_size")
    out.update((f"{prefix}.{name}", shape(h, v)) for name, shape in extras.items())
    return out


def mtp_carried(decoder_layer: ClassRef, config_class: ClassRef, extras: Extras
                ) -> Callable[[Mapping[str, Any]], CarriedModules | None]:
    """``SourceCheckSpec.carried``: the ``num_nextn_predict_layers`` MTP layers of a config, or None."""

    def carried_modules(config: Mapping[str, Any]) -> CarriedModules | None:
        first, n = positive_int(config, "num_hidden_layers"), config.get("num_nextn_predict_layers") or 0
        if not n:
            return None
        tensors: dict[str, tuple[int, ...]] = {}
        for layer in range(first, first + n):
            tensors.update(mtp_layer_shapes(decoder_layer, config_class, config, layer, extras))
        return CarriedModules(tuple(f"model.layers.{i}" for i in range(first, first + n)), tensors, MTP_REASON)

    return carried_modules
