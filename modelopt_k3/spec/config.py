"""Reading a model's config.json fields the way every spec's source check needs them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .contract import SpecError

__all__ = ["load_dtype", "positive_int"]


def positive_int(config: Mapping[str, Any], name: str, *, label: str | None = None) -> int:
    """``config[name]`` as a positive int (a bool is no int here), else ``SpecError`` quoting the value under
    ``label`` (default ``config.json <name>``)."""
    value = config.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SpecError(f"{label or f'config.json {name}'} = {value!r}; a positive integer is needed")
    return value


def _field(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def load_dtype(config: Any) -> Any:
    """The dtype a run loads the model in when ``--dtype`` is not given: transformers' ``dtype="auto"`` rule
    (``modeling_utils._get_dtype``: the top-level config's ``dtype``, spelled ``torch_dtype`` in older
    config.json files), then a composite config's ``text_config`` (transformers would read the weights' dtype
    here; the text model's declared dtype is what those weights are), then bfloat16. ``config``: config.json as
    a dict or a transformers config. The one rule: the preflight, the memory layout, the converter and the
    library load all call it (``RunPlan.dtype`` carries its answer through a run)."""
    import torch

    text = _field(config, "text_config")
    names = [_field(config, "dtype"), _field(config, "torch_dtype")]
    if text is not None:
        names += [_field(text, "dtype"), _field(text, "torch_dtype")]
    name = next((n for n in names if n), "bfloat16")
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise SpecError(f"config.json names dtype {name!r}, which is no torch floating-point dtype; fix config.json "
                        "or pass --dtype bfloat16/float32")
    return dtype
