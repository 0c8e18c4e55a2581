"""Block-FP8 source weights (DeepSeek-V3/R1, Kimi-K2: ``quant_method: fp8``, ``weight_block_size: [bm, bn]``).

Layout: ``weight`` float8_e4m3fn ``[..., out, in]`` and ``weight_scale_inv`` (fp32 or bf16)
``[..., ceil(out/bm), ceil(in/bn)]``; despite its name the scale multiplies:
``w[r, c] = float(weight[r, c]) * float(weight_scale_inv[r // bm, c // bn])`` in fp32, one cast to the
output dtype (what transformers' ``Fp8Dequantize`` and the engines' block-FP8 loaders compute).

Decisions:

- The block is the **declared** ``weight_block_size``, never inferred from the scale grid: a trailing
  partial block (DeepSeek-V3's ``kv_a_proj_with_mqa``: 576 rows, 5 scale rows; a 192-row weight: 2) takes
  the scale of its block index. transformers 5.24's ``Fp8Dequantize`` divides rows by scale rows instead,
  which raises on 576/5 and gives 96-row blocks for 192/2.
- The fp32 product of an E4M3 value (4 significant bits) and an fp32 scale is rounded once, to fp32;
  a bf16 output then rounds once more, exactly as the reference does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .constants import FP8_BLOCK

__all__ = ["block_fp8_decode", "block_fp8_scale_shape"]

_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def block_fp8_scale_shape(shape: tuple[int, ...], block_size: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> tuple[int, ...]:
    """The ``weight_scale_inv`` shape of a ``weight`` of ``shape`` under ``block_size``."""
    bm, bn = _check_block(block_size)
    if len(shape) < 2:
        raise ValueError(f"a block-FP8 weight needs shape [..., out, in], got {list(shape)}")
    *lead, rows, cols = shape
    return (*lead, -(-rows // bm), -(-cols // bn))


def _check_block(block_size) -> tuple[int, int]:
    try:
        bm, bn = (int(b) for b in block_size)
    except (TypeError, ValueError):
        raise ValueError(f"weight_block_size must be two positive integers, got {block_size!r}") from None
    if bm <= 0 or bn <= 0 or list(block_size) != [bm, bn]:
        raise ValueError(f"weight_block_size must be two positive integers, got {block_size!r}")
    return bm, bn


def block_fp8_decode(
    weight: Tensor,
    scale_inv: Tensor,
    block_size: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK),
    dtype: torch.dtype = torch.bfloat16,
    out: Tensor | None = None,
) -> Tensor:
    """``float(weight) * scale_inv`` expanded over its ``block_size`` blocks, cast to ``dtype`` (module docstring).

    ``out``: a tensor of ``weight``'s shape and ``dtype`` to write into (returned).
    """
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"a block-FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    if scale_inv.dtype not in _SCALE_DTYPES:
        raise ValueError(f"weight_scale_inv must be float32/bfloat16/float16, got {scale_inv.dtype}")
    bm, bn = _check_block(block_size)
    want = block_fp8_scale_shape(tuple(weight.shape), (bm, bn))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv of a {list(weight.shape)} weight with weight_block_size [{bm}, {bn}] "
                         f"must be {list(want)}, got {list(scale_inv.shape)}")
    if out is not None and (tuple(out.shape) != tuple(weight.shape) or out.dtype != dtype):
        raise ValueError(f"out must be {dtype} {list(weight.shape)}, got {out.dtype} {list(out.shape)}")
    rows, cols = weight.shape[-2:]
    # Rows expanded (a scale-sized tensor times bm), columns broadcast per whole block, the tail on its own.
    scale = scale_inv.float().repeat_interleave(bm, dim=-2)[..., :rows, :]
    values = weight.float()
    full, rem = divmod(cols, bn)
    if full:
        values[..., : full * bn].unflatten(-1, (full, bn)).mul_(scale[..., :full, None])
    if rem:
        values[..., full * bn :].mul_(scale[..., full:])
    if out is None:
        return values.to(dtype)
    return out.copy_(values)
