"""Running transformers ``WeightConverter`` chains outside ``from_pretrained``.

transformers applies converters inside its own loader; ours reads the tensors itself (only this
rank's, lazily), so it runs a converter's operation chain on tensors already grouped by pattern.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.core_model_loading import WeightConverter


def run_converter(
    converter: WeightConverter, tensors_by_pattern: dict[str, list[torch.Tensor]], **context: Any
) -> torch.Tensor:
    """Apply ``converter.operations`` to ``{source pattern: [tensor per expert, in expert order]}``.

    ``context`` is what transformers' loader passes every op besides the tensors (``full_layer_name``,
    ``model``); ops that size their output from the target parameter read it from there.
    """
    current: dict[str, Any] = dict(tensors_by_pattern)
    for op in converter.operations:
        current = op.convert(
            current, source_patterns=converter.source_patterns, target_patterns=converter.target_patterns, **context
        )
    if len(current) != 1:
        raise ValueError(f"{converter} produced {len(current)} tensors, expected one")
    (result,) = current.values()
    return result
