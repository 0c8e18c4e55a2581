"""Running transformers ``WeightConverter`` chains outside ``from_pretrained``.

transformers applies converters inside its own loader; ours reads the tensors itself (only this
rank's, lazily), so it runs a converter's operation chain on tensors already grouped by pattern.

A chain may start with a ``DecodeOp`` (a block-scaled source format decoded to floats, e.g.
MXFP4). With packed-resident experts (``packed_experts.py``) the loader runs the same chain
without it, once per stored field (codes, scales): stacking and concatenation are the same
operations on the source bytes, so the packed fields land in exactly the fused layout the decoded
weights would have.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.core_model_loading import Concatenate, ConversionOps, MergeModulelist, WeightConverter


class DecodeOp(ConversionOps):
    """A conversion op that decodes a block-scaled source format.

    ``codes_field`` / ``scales_field``: the checkpoint tensor suffixes of the packed codes and their
    block scales (source patterns end with them). ``decode`` turns (codes, scales) of any leading shape
    into values, optionally into ``out``.
    """

    codes_field: str
    scales_field: str

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None):
        raise NotImplementedError


def decodes_after_layout(converter: WeightConverter) -> bool:
    """True when the chain is a decode followed only by stacking and concatenation.

    Those move whole rows (and, along the last dim, whole 32-element blocks with their scales), and the
    decode maps every block on its own, so decoding the rearranged codes and scales gives exactly the
    chain's result: the loader then decodes straight into the parameter, with no decoded intermediate.
    """
    op = decode_op(converter)
    rest = converter.operations[1:]
    return op is not None and converter.operations[0] is op and all(isinstance(o, (MergeModulelist, Concatenate)) for o in rest)


def run_converter(
    converter: WeightConverter, tensors_by_pattern: dict[str, list[torch.Tensor]], **context: Any
) -> torch.Tensor:
    """Apply ``converter.operations`` to ``{source pattern: [tensor per expert, in expert order]}``.

    ``context`` is what transformers' loader passes every op besides the tensors (``full_layer_name``,
    ``model``); ops that size their output from the target parameter read it from there.
    """
    return _run_chain(converter.operations, converter.source_patterns, converter, tensors_by_pattern, **context)


def decode_op(converter: WeightConverter) -> DecodeOp | None:
    """The converter's decode step, or None when its source is stored unpacked."""
    ops = [op for op in converter.operations if isinstance(op, DecodeOp)]
    if len(ops) > 1:
        raise ValueError(f"{converter} has {len(ops)} decode steps; expected at most one")
    return ops[0] if ops else None


def run_converter_fields(
    converter: WeightConverter, tensors_by_pattern: dict[str, list[torch.Tensor]], **context: Any
) -> dict[str, torch.Tensor]:
    """The converter's chain without its ``DecodeOp``, run once per stored field.

    Returns ``{codes_field: fused codes, scales_field: fused scales}`` in the fused layout.
    """
    op = decode_op(converter)
    if op is None:
        raise ValueError(f"{converter} has no decode step: its source is not packed")
    rest = [o for o in converter.operations if o is not op]
    out = {}
    for field in (op.codes_field, op.scales_field):
        patterns = [p for p in converter.source_patterns if p.endswith(field)]
        out[field] = _run_chain(rest, patterns, converter, {p: tensors_by_pattern[p] for p in patterns}, **context)
    return out


def _run_chain(ops, source_patterns: list[str], converter: WeightConverter, tensors: dict[str, Any],
               **context: Any) -> torch.Tensor:
    current: dict[str, Any] = dict(tensors)
    for op in ops:
        current = op.convert(current, source_patterns=source_patterns, target_patterns=converter.target_patterns,
                             **context)
    if len(current) != 1:
        raise ValueError(f"{converter} produced {len(current)} tensors, expected one")
    (result,) = current.values()
    return result
