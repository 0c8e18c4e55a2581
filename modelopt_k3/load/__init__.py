"""Loading a checkpoint into the placed model: whole (``pretrained``: ``load_pretrained``, and ``load_planned``
for a run the preflight planned) or one decoder layer at a time (``layerwise``: ``LayerwiseLoad``)."""

from .layerwise import LayerwiseLoad, keys_by_layer, release_tensors
from .pretrained import (
    Loaded,
    LoadError,
    LoadInfo,
    LoadScope,
    PlacedBuild,
    build_planned,
    check_against_model,
    load_planned,
    load_pretrained,
    materialize,
    persistent_tensors,
    read_scope,
    resolve_model_class,
)

__all__ = [
    "LayerwiseLoad",
    "LoadError",
    "LoadInfo",
    "LoadScope",
    "Loaded",
    "PlacedBuild",
    "build_planned",
    "check_against_model",
    "keys_by_layer",
    "load_planned",
    "load_pretrained",
    "materialize",
    "persistent_tensors",
    "read_scope",
    "release_tensors",
    "resolve_model_class",
]
