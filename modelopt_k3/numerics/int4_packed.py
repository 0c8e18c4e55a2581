"""INT4 source weights, compressed-tensors ``pack-quantized`` (Kimi-K2.5/K2.6 routed experts): decode and pack.

Layout (compressed-tensors ``PackedQuantizationCompressor``, num_bits 4, symmetric, group strategy):
``weight_packed`` int32 ``[..., out, ceil(in/8)]``: element ``i`` of a row sits in bits ``4*(i % 8)`` of word
``i // 8`` (little-endian nibbles) as the unsigned code ``q + 8``, so ``q = nibble - 8`` in ``-8..7``;
``weight_scale`` ``[..., out, in/group]`` (bf16 in the hub checkpoints); ``weight_shape`` int32 ``[2]`` =
``[out, in]``. No zero point (symmetric).
``w[r, c] = q[r, c] * weight_scale[r, c // group]``: the product of a 4-bit integer and a bf16/fp32 scale is
exact in fp32 and rounded once to the output dtype (the reference multiplies in the scale's dtype, which
for bf16 rounds that same exact product once).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["INT4_GROUP", "int4_pack", "int4_packed_decode", "int4_unpack"]

INT4_GROUP = 32  # Kimi-K2.5/K2.6's group_size
_PER_WORD = 8
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def int4_unpack(packed: Tensor, in_features: int) -> Tensor:
    """int32 ``[..., out, ceil(in/8)]`` -> int8 ``[..., out, in]`` values in ``-8..7``."""
    if packed.dtype != torch.int32:
        raise ValueError(f"weight_packed must be int32, got {packed.dtype}")
    if packed.dim() < 2:
        raise ValueError(f"weight_packed needs shape [..., out, in/8], got {list(packed.shape)}")
    words = packed.shape[-1]
    if not 0 < in_features <= words * _PER_WORD or -(-in_features // _PER_WORD) != words:
        raise ValueError(f"weight_packed with {words} words a row cannot hold in_features={in_features}")
    # Bytes of each little-endian word: word w's byte b holds elements 8w+2b (low nibble) and 8w+2b+1 (high).
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles.to(torch.int8) - 8).flatten(-2)[..., :in_features]


def int4_pack(values: Tensor) -> Tensor:
    """int8 ``[..., out, in]`` in ``-8..7`` -> int32 ``[..., out, ceil(in/8)]`` (the inverse of ``int4_unpack``)."""
    if values.dtype != torch.int8 or values.dim() < 2:
        raise ValueError(f"int4_pack needs an int8 [..., out, in] tensor, got {values.dtype} {list(values.shape)}")
    if values.numel() and (values.min() < -8 or values.max() > 7):
        raise ValueError("int4_pack needs values in -8..7")
    cols = values.shape[-1]
    pad = -cols % _PER_WORD
    codes = torch.nn.functional.pad(values.to(torch.int64) + 8, (0, pad)).unflatten(-1, (-1, _PER_WORD))
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    words = (codes << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def int4_packed_decode(
    packed: Tensor,
    scale: Tensor,
    in_features: int | None = None,
    group_size: int = INT4_GROUP,
    dtype: torch.dtype = torch.bfloat16,
    out: Tensor | None = None,
) -> Tensor:
    """``int4_unpack(packed) * scale`` per ``group_size`` columns, in ``dtype`` (module docstring).

    ``in_features`` defaults to ``scale.shape[-1] * group_size`` (exact for the group strategy).
    """
    if scale.dtype not in _SCALE_DTYPES:
        raise ValueError(f"weight_scale must be float32/bfloat16/float16, got {scale.dtype}")
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    groups = scale.shape[-1] if scale.dim() else 0
    in_features = groups * group_size if in_features is None else in_features
    if scale.dim() != packed.dim() or tuple(scale.shape[:-1]) != tuple(packed.shape[:-1]) \
            or groups != -(-in_features // group_size):
        raise ValueError(f"weight_scale {list(scale.shape)} does not match weight_packed {list(packed.shape)} with "
                         f"in_features={in_features}, group_size={group_size}")
    q = int4_unpack(packed, in_features).float()
    full = scale.float().repeat_interleave(group_size, dim=-1)[..., :in_features]
    values = q * full
    if out is None:
        return values.to(dtype)
    if tuple(out.shape) != tuple(values.shape) or out.dtype != dtype:
        raise ValueError(f"out must be {dtype} {list(values.shape)}, got {out.dtype} {list(out.shape)}")
    return out.copy_(values)
