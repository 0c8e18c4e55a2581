"""Counting values that are not numbers: NaN/Inf in floating tensors, NaN bytes of E8M0 scales.

Both first answer "any?" with one reduction that allocates nothing the size of the input
(``aminmax`` propagates NaN and shows +-Inf; the E8M0 NaN byte 255 is the largest byte), and count
only when the answer is yes, so checking a tensor that was just read costs about one read of it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .constants import E8M0_NAN

__all__ = ["e8m0_nan_count", "nonfinite_count"]

# float8 dtypes have no aminmax on CPU; their NaN/Inf are bit patterns (e4m3fn: S.1111.111, no Inf).
_FP8_SPECIALS = {torch.float8_e4m3fn: (0x7F, 0x7F), torch.float8_e5m2: (0x7C, 0x7C)}


def nonfinite_count(x: Tensor) -> int:
    """Number of NaN and +-Inf elements of ``x`` (0 for integer and bool tensors)."""
    if not x.dtype.is_floating_point or x.numel() == 0:
        return 0
    if x.dtype in _FP8_SPECIALS:
        mask, pattern = _FP8_SPECIALS[x.dtype]
        return int(((x.view(torch.uint8) & mask) == pattern).sum())
    low, high = torch.aminmax(x)
    if bool(torch.isfinite(low)) and bool(torch.isfinite(high)):
        return 0
    return int(x.numel() - torch.isfinite(x).sum())


def e8m0_nan_count(scales: Tensor) -> int:
    """Number of E8M0 scale bytes that encode NaN (255, OCP MX spec) in a uint8 tensor."""
    if scales.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales are uint8, got {scales.dtype}")
    if scales.numel() == 0 or int(scales.max()) != E8M0_NAN:
        return 0
    return int((scales == E8M0_NAN).sum())
