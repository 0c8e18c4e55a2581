"""Running transformers ``WeightConverter`` chains outside ``from_pretrained``.

transformers applies converters inside its own loader; ours reads the tensors itself (only this
rank's, lazily), so it runs a converter's operation chain on tensors already grouped by pattern.

A chain may start with a ``DecodeOp`` (a block-scaled source format decoded to floats, e.g.
MXFP4). With packed-resident experts (``experts/packed.py``) the loader runs the same chain
without it, once per stored field (codes, scales): stacking and concatenation are the same
operations on the source bytes, so the packed fields land in exactly the fused layout the decoded
weights would have.
"""

from __future__ import annotations

from typing import Any, NamedTuple

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
    # A stored tensor beside them that declares the decoded shape (compressed-tensors' ``weight_shape``):
    # checked against the codes' decoded shape, never trusted in its place; None: the format has none.
    shape_field: str | None = None

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None):
        raise NotImplementedError

    def decoded_shape(self, codes_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The decoded values' shape for codes of ``codes_shape``: two 4-bit codes a byte along the last dim."""
        return (*codes_shape[:-1], codes_shape[-1] * 2)

    def block_fp8_block(self, config: Any) -> tuple[int, int] | None:
        """The (rows, cols) block when this format is block FP8 (E4M3 codes times one scale per block, the
        block ``config`` declares), so a format holding that block can take the stored bytes as they are;
        None for any other encoding."""
        return None

    def scales_pattern(self, codes_pattern: str) -> str:
        """The source pattern of the scales that go with the codes of ``codes_pattern``."""
        return codes_pattern[: -len(self.codes_field)] + self.scales_field

    def shape_pattern(self, codes_pattern: str) -> str | None:
        """The source pattern of the declared shape that goes with ``codes_pattern`` (None: no such field)."""
        return None if self.shape_field is None else codes_pattern[: -len(self.codes_field)] + self.shape_field


def decodes_after_layout(converter: WeightConverter) -> bool:
    """True when the chain is a decode followed only by stacking and concatenation.

    Those move whole rows (and, along the last dim, whole 32-element blocks with their scales), and the
    decode maps every block on its own, so decoding the rearranged codes and scales gives exactly the
    chain's result: the loader then decodes straight into the parameter, with no decoded intermediate.
    """
    op = decode_op(converter)
    rest = converter.operations[1:]
    return op is not None and converter.operations[0] is op and all(isinstance(o, (MergeModulelist, Concatenate)) for o in rest)


class SourceBlock(NamedTuple):
    """Where one source tensor (``pattern``'s ``index``-th, in the order given) lands in a chain's result."""

    pattern: str
    index: int
    where: tuple[slice, ...]  # the region of the result it fills: one slice per result dim
    shape: tuple[int, ...]  # the source tensor's own shape (the region without the dims the chain added)


def layout_blocks(
    converter: WeightConverter, shapes_by_pattern: dict[str, list[tuple[int, ...]]]
) -> tuple[tuple[int, ...], list[SourceBlock]]:
    """(result shape, where every source tensor lands) for a decoding chain (``decodes_after_layout``),
    from shapes alone: the loader then decodes each source straight into its region of the parameter.

    ``shapes_by_pattern``: the decoded shape of each codes pattern's tensors, in list order. The stack and
    concatenation steps are followed as the chain's own ops run them (the same dict keys, order and dims,
    ``get_target_pattern`` included); a layout step of another kind is refused.
    """
    if not decodes_after_layout(converter):
        raise ValueError(f"{converter}: not a decode followed only by stacking and concatenation")
    # value: (shape, blocks) for one tensor, or a list of them (one per expert, before stacking)
    current: dict[str, Any] = {
        p: [(tuple(s), [SourceBlock(p, i, tuple(slice(0, d) for d in s), tuple(s))]) for i, s in enumerate(shapes)]
        for p, shapes in shapes_by_pattern.items()
    }
    for op in converter.operations[1:]:
        if isinstance(op, MergeModulelist):
            size = len(current)
            current = {op.get_target_pattern(size, key, converter.target_patterns): _stack_blocks(value, op.dim)
                       for key, value in list(current.items())}
        else:  # Concatenate: the patterns present, in source order (the op pops them the same way)
            parts = []
            for pattern in converter.source_patterns:
                if pattern in current:
                    value = current.pop(pattern)
                    parts.extend(value if isinstance(value, list) else [value])
            current = {op.get_target_pattern(converter.target_patterns): _cat_blocks(parts, op.dim)}
    if len(current) != 1:
        raise ValueError(f"{converter} produced {len(current)} tensors, expected one")
    ((shape, blocks),) = current.values()
    return shape, blocks


def _stack_blocks(value, dim: int):
    if not isinstance(value, list):  # a stacked tensor passes through (as MergeModulelist does)
        return value
    shapes = {shape for shape, _ in value}
    if len(shapes) != 1:
        raise ValueError(f"cannot stack tensors of shapes {sorted(shapes)}")
    (shape,) = shapes
    d = dim % (len(shape) + 1)
    blocks = [b._replace(where=(*b.where[:d], slice(i, i + 1), *b.where[d:]))
              for i, (_, bs) in enumerate(value) for b in bs]
    return (*shape[:d], len(value), *shape[d:]), blocks


def _cat_blocks(parts: list, dim: int):
    ndim = len(parts[0][0])
    d = dim % ndim
    if any(len(s) != ndim or s[:d] + s[d + 1 :] != parts[0][0][:d] + parts[0][0][d + 1 :] for s, _ in parts):
        raise ValueError(f"cannot concatenate tensors of shapes {[s for s, _ in parts]} along dim {dim}")
    blocks, offset = [], 0
    for shape, bs in parts:
        for b in bs:
            w = b.where[d]
            blocks.append(b._replace(where=(*b.where[:d], slice(w.start + offset, w.stop + offset), *b.where[d + 1 :])))
        offset += shape[d]
    return (*parts[0][0][:d], offset, *parts[0][0][d + 1 :]), blocks


def run_converter(
    converter: WeightConverter, tensors_by_pattern: dict[str, list[torch.Tensor]], **context: Any
) -> torch.Tensor:
    """Apply ``converter.operations`` to ``{source pattern: [tensor per expert, in expert order]}``.

    ``context`` is what transformers' loader passes every op besides the tensors (``full_layer_name``, ``dtype``: the target parameter's, which decode ops write,
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
