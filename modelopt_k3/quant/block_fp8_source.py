"""Block-FP8 passthrough: a dense Linear whose recipe format holds its block-FP8 source bytes as stored.

A Linear stored block-FP8 (``weight`` E4M3 + ``weight_scale_inv``, ``numerics.block_fp8``) is loaded decoded.
When the recipe gives it a weight format that holds the same block losslessly (``fp8_pb``:
``TensorFormat.holds_block_fp8``), requantizing the decoded weight (rounded to the run's dtype) by block
amax / 448 would change codes and scales for nothing. Instead the export writes the source's codes and
scales, read again lazily by the rank that writes them, and fake quant is the decode itself, which the
loaded weight already is. The streaming converter decides with the same function
(``block_fp8_passthrough``) and copies the same bytes, so both paths agree byte for byte. Where the bytes
cannot be held (another block, shapes the headers disagree on, a weight stored plain) the weight is
requantized as before, and the label says why (the report's ``calibration``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoint import CheckpointReader
from ..numerics.block_fp8 import block_fp8_decode, block_fp8_scale_shape
from ..spec.conversion import decode_op
from .schemes import TensorFormat

PASSTHROUGH = "passthrough (the block-FP8 source's codes and scales, as stored)"


@dataclass(frozen=True)
class Passthrough:
    """The stored tensors a passed-through weight is written from: codes and scales keys, and their block."""

    codes: str
    scales: str
    block: tuple[int, int]


def block_fp8_passthrough(
    name: str, fmt: TensorFormat, shape: tuple[int, int], dense: Mapping[str, tuple[Any, Mapping[str, str]]],
    headers: Mapping[str, Any], config: Any,
) -> tuple[Passthrough | None, str]:
    """Whether dense Linear ``name`` (weight ``shape``, weight format ``fmt``) is written as its block-FP8
    source bytes, and the label saying so (or why not: then it is requantized).

    ``dense``: the dense weights a spec converter decodes at load (``checkpoint.source_decode.dense_decodes``: target ->
    (converter, {pattern: source key})); ``headers``: the source's tensor headers (dtype, shape);
    ``config``: the model's config, where the source declares its block. The model path and the streaming
    converter both ask this, with the same arguments, so they take the same branch.
    """
    if fmt.holds_block_fp8 is None:
        return None, f"max ({fmt} holds no block-FP8 source)"
    entry = dense.get(f"{name}.weight")
    op = decode_op(entry[0]) if entry is not None else None
    block = op.block_fp8_block(config) if op is not None else None
    if block is None:
        return None, f"max (requantized: {name} is not stored block-FP8)"
    block = tuple(int(b) for b in block)
    if block != tuple(fmt.holds_block_fp8):
        return None, (f"max (requantized: the source's weight_block_size {list(block)} is not the "
                      f"{list(fmt.holds_block_fp8)} block {fmt} holds)")
    keys = entry[1].values()
    codes = next((k for k in keys if k.endswith(f".{op.codes_field}")), None)
    scales = next((k for k in keys if k.endswith(f".{op.scales_field}")), None)
    if codes is None or scales is None:
        return None, f"max (requantized: {name} has no {op.codes_field} + {op.scales_field} pair)"
    c, s = headers[codes], headers[scales]
    if c.dtype != torch.float8_e4m3fn or tuple(c.shape) != tuple(shape):
        return None, (f"max (requantized: {codes} is {c.dtype} {list(c.shape)}, not float8_e4m3fn "
                      f"{list(shape)})")
    want = block_fp8_scale_shape(tuple(shape), block)
    if tuple(s.shape) != want:
        return None, f"max (requantized: {scales} is {list(s.shape)}, the block {list(block)} needs {list(want)})"
    return Passthrough(codes, scales, block), PASSTHROUGH


class BlockFp8Source:
    """One passed-through weight on the model path: its source bytes, read on demand (never held)."""

    def __init__(self, reader: CheckpointReader, where: Passthrough, dtype: torch.dtype) -> None:
        self.reader, self.where = reader, where
        self.dtype = dtype  # the loaded weight's: the load decoded the source into it

    def tensors(self, fmt: TensorFormat) -> dict[str, torch.Tensor]:
        """The exported tensors: the source's codes and scales, as ``fmt`` writes them."""
        return fmt.block_fp8_tensors(self.reader.get(self.where.codes), self.reader.get(self.where.scales))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """What the export holds, dequantized (code * block scale in fp32, one rounding to ``dtype``)."""
        return block_fp8_decode(self.reader.get(self.where.codes), self.reader.get(self.where.scales),
                                self.where.block, dtype)

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        # The module's weight is this very decode (the loader's block-FP8 decode into its dtype, which no
        # algorithm rewrites: updated weights are quantized instead), so it is returned as is, not read again.
        if x.dtype == self.dtype:
            return x
        return self.dequantize(x.dtype).to(x.device)
