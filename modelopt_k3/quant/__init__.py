"""Quantizers, recipe matching, the decision table and ``max`` calibration; ``schemes``: the format registry.

The public names are imported lazily, so that importing ``quant.schemes`` (which the recipe layer below
this package needs) does not import the quantization machinery above it.
"""

from __future__ import annotations

import importlib
from typing import Any

_API = {
    "Decision": ".decisions",
    "DecisionTable": ".decisions",
    "QuantPlan": ".api",
    "SharedInputRule": ".shared_inputs",
    "TensorQuantizer": ".quantizer",
    "decide": ".decisions",
    "discover_shared_inputs": ".shared_inputs",
    "plan_quantization": ".api",
    "quantize": ".api",
    "quantize_planned": ".api",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
