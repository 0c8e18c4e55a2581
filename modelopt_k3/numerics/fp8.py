"""FP8 E4M3 weights: per-tensor and 128x128-block scales (docs/FORMATS.md, "FP8 (E4M3)").

Quantization is ``(w / scale)`` in fp32, clamped to ±448, then ``.to(torch.float8_e4m3fn)``
(round to nearest even); dequantization is ``float(q) * scale`` in fp32, cast to the output dtype.

Decisions:

- ``fp8_scale(amax) = amax / 448``; amax == 0 gives 1.0 (a zero scale would make the division
  NaN; any scale encodes an all-zero tensor exactly). The same rule gives an all-zero 128x128
  block the scale 1.0.
- Blocks: a dimension that is not a multiple of 128 gets a smaller edge block (rows
  ``128*(R-1):out`` or columns ``128*(C-1):in``) whose scale is that partial block's amax / 448,
  so the block scales are ``[ceil(out/128), ceil(in/128)]`` for every shape (the ModelOpt export
  stores them as ``[ceil(out/128), 1, ceil(in/128), 1]``, export/modelopt_format.py). Nothing is
  left unquantized.
- NaN stays NaN (E4M3 NaN); ±inf clamps to ±448.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .constants import FP8_BLOCK, FP8_E4M3_MAX

__all__ = [
    "fp8_dequantize_blockwise",
    "fp8_dequantize_per_tensor",
    "fp8_fake_quant_blockwise",
    "fp8_fake_quant_per_tensor",
    "fp8_quantize_blockwise",
    "fp8_quantize_per_tensor",
    "fp8_scale",
]

_E4M3 = torch.float8_e4m3fn


def fp8_scale(amax: Tensor | float) -> Tensor:
    """``amax / 448`` in fp32 (same shape as ``amax``); amax == 0 gives 1.0."""
    amax = torch.as_tensor(amax).float()
    # a device tensor divisor: CUDA multiplies by the reciprocal of a Python scalar (other rounding)
    return torch.where(amax == 0, 1.0, amax / amax.new_tensor(FP8_E4M3_MAX))


def _to_e4m3(q: Tensor) -> Tensor:
    return q.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(_E4M3)


def fp8_quantize_per_tensor(w: Tensor, scale: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
    """``(e4m3 weight, fp32 scale [])``; ``scale`` defaults to ``fp8_scale(amax(w))``."""
    if not w.is_floating_point():
        raise ValueError(f"fp8_quantize_per_tensor needs a float tensor, got {w.dtype}")
    if scale is None:
        scale = fp8_scale(w.abs().amax() if w.numel() else torch.zeros(()))
    scale = torch.as_tensor(scale, dtype=torch.float32, device=w.device)
    if scale.numel() != 1:
        raise ValueError(f"per-tensor FP8 needs a single scale, got shape {tuple(scale.shape)}")
    scale = scale.reshape(())
    return _to_e4m3(w.float() / scale), scale  # .float() first: a 0-d scale would not promote bf16


def fp8_dequantize_per_tensor(q: Tensor, scale: Tensor | float, dtype: torch.dtype = torch.float32) -> Tensor:
    """``float(q) * scale`` in fp32, cast to ``dtype``."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=q.device).reshape(())
    return (q.float() * scale).to(dtype)


def fp8_fake_quant_per_tensor(x: Tensor, scale: Tensor | float) -> Tensor:
    """``fp8_dequantize_per_tensor(*fp8_quantize_per_tensor(x, scale), x.dtype)`` (no gradient)."""
    q, s = fp8_quantize_per_tensor(x.detach(), scale)
    return fp8_dequantize_per_tensor(q, s, x.dtype)


def _check_2d(w: Tensor, what: str) -> None:
    if w.dim() < 2:
        raise ValueError(f"{what} needs a [..., out, in] tensor, got shape {tuple(w.shape)}")


def _padded_blocks(w: Tensor, block: int) -> tuple[Tensor, int, int]:
    """``w`` zero-padded to whole blocks, viewed ``[..., R, block, C, block]``."""
    *lead, rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    if nr * block != rows or nc * block != cols:
        w = F.pad(w, (0, nc * block - cols, 0, nr * block - rows))
    return w.reshape(*lead, nr, block, nc, block), nr, nc


def fp8_quantize_blockwise(w: Tensor, block: int = FP8_BLOCK) -> tuple[Tensor, Tensor]:
    """``(e4m3 weight [..., out, in], fp32 scale [..., ceil(out/block), ceil(in/block)])``.

    Scale = block amax / 448 (partial edge blocks use their own amax; an all-zero block gets 1.0).
    """
    _check_2d(w, "fp8_quantize_blockwise")
    if not w.is_floating_point():
        raise ValueError(f"fp8_quantize_blockwise needs a float tensor, got {w.dtype}")
    rows, cols = w.shape[-2:]
    wb, _, _ = _padded_blocks(w.float() if w.dtype == torch.float64 else w, block)
    scale = fp8_scale(wb.abs().amax(dim=(-3, -1)))
    q = torch.div(wb, scale.unsqueeze(-1).unsqueeze(-3))
    q = _to_e4m3(q).flatten(-4, -3).flatten(-2, -1)
    return q[..., :rows, :cols].contiguous(), scale


def fp8_dequantize_blockwise(
    q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32, block: int = FP8_BLOCK
) -> Tensor:
    """``float(q) * scale[i // block, j // block]`` in fp32, cast to ``dtype``."""
    _check_2d(q, "fp8_dequantize_blockwise")
    rows, cols = q.shape[-2:]
    nr, nc = -(-rows // block), -(-cols // block)
    if tuple(scale.shape[-2:]) != (nr, nc):
        raise ValueError(
            f"block scale for a weight of shape {tuple(q.shape)} must end in ({nr}, {nc}), got {tuple(scale.shape)}"
        )
    full = scale.float().repeat_interleave(block, dim=-2)[..., :rows, :].repeat_interleave(block, dim=-1)
    return (q.float() * full[..., :cols]).to(dtype)


def fp8_fake_quant_blockwise(w: Tensor, block: int = FP8_BLOCK) -> Tensor:
    """``fp8_dequantize_blockwise(*fp8_quantize_blockwise(w, block), w.dtype, block)`` (no gradient)."""
    q, s = fp8_quantize_blockwise(w.detach(), block)
    return fp8_dequantize_blockwise(q, s, w.dtype, block)
