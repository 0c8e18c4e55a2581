"""E2M1 (FP4) codes: rounding, decoding and nibble packing (docs/FORMATS.md, "E2M1").

Code layout: bit 3 is the sign, bits 0-2 index the magnitudes ``[0, .5, 1, 1.5, 2, 3, 4, 6]``.

Rounding decisions (all tested bit for bit):

- Magnitude: round half to even onto the grid, saturating at 6. This is exactly the FORMATS.md
  threshold rule: the code is the number of thresholds ``[.25, .75, 1.25, 1.75, 2.5, 3.5, 5]``
  strictly below ``|x|``, plus one when ``|x|`` is exactly 0.75, 1.75 or 3.5.
- Sign: the sign bit of the input is always kept, as IEEE rounding does. ``-0.0`` and negatives
  that round to zero magnitude give code 8 (``-0``); they decode to ``-0.0`` (== 0).
- ``±inf`` saturate to ``±6`` (codes 7 / 15).
- NaN saturates to ``±6`` by the NaN's sign bit (E2M1 has no NaN; the loudest finite value is
  used). NVFP4 quantization does not rely on this: a block holding a NaN gets a NaN block scale,
  so the whole block dequantizes to NaN whatever its codes.

Implementation (fp32 path): the fp32 bit pattern ``b`` of ``x`` is mapped to an 11-bit key
``((b + 0x1FFFFF + bit22(b)) >> 21) & 0x7FF`` (sign, exponent and two mantissa bits, rounded
up for mantissas below 1.5 and down-plus-one above) and the key indexes a 2048-entry table.
Every E2M1 threshold has at most two mantissa bits, ties-down thresholds (.25, 1.25, 2.5, 5) sit
where the key rounds up and ties-up thresholds (.75, 1.75, 3.5) where it rounds down, so each
key covers values of a single code. This was checked exhaustively over all 2**30 fp32 patterns
in [0, 6]; the tests recheck a dense sweep around every threshold.
"""

from __future__ import annotations

import struct

import torch
from torch import Tensor

__all__ = ["E2M1_VALUES", "e2m1_decode", "e2m1_round", "pack_fp4", "unpack_fp4"]

E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
"""Decoded value of each of the 16 codes, in code order (``torch.tensor(E2M1_VALUES)``)."""

_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)


def _magnitude_code(mag: float) -> int:
    """FORMATS.md threshold rule for one non-negative Python float (reference, used to build tables)."""
    if mag != mag:  # NaN saturates
        return 7
    return sum(t < mag for t in _THRESHOLDS) + (mag in _TIES_UP)


def _key_of_bits(bits: int) -> int:
    """The 11-bit table key of one fp32 bit pattern (Python mirror of ``_e2m1_keys``)."""
    b = bits - (1 << 32) if bits & 0x80000000 else bits
    return ((b + 0x1FFFFF + ((b >> 22) & 1)) >> 21) & 0x7FF


def _build_key_table() -> list[int]:
    table = [-1] * 2048
    for sign in (0, 1):
        for j in range(1024):
            for delta in (0, 1, 1 << 20, (1 << 21) - 1):
                a = min((j << 21) + delta, 0x7F800000)  # clamp to inf; NaN keys are filled below
                bits = a | (sign << 31)
                key = _key_of_bits(bits)
                mag = abs(struct.unpack("<f", struct.pack("<I", bits))[0])
                code = _magnitude_code(mag) | (sign << 3)
                assert table[key] in (-1, code), "E2M1 key table is inconsistent"
                table[key] = code
    for key in range(2048):  # keys above +-inf: canonical NaNs; saturate by sign
        if table[key] == -1:
            table[key] = 7 | ((key >> 10) << 3)
    return table


_KEY_TO_CODE: list[int] = _build_key_table()
_TABLES: dict[tuple, Tensor] = {}


def _table(kind: str, device: torch.device) -> Tensor:
    """Cached lookup tables: key->code (uint8), key->value (fp32), code->value (fp32)."""
    cached = _TABLES.get((kind, device))
    if cached is not None:
        return cached
    if kind == "key_code":
        t = torch.tensor(_KEY_TO_CODE, dtype=torch.uint8)
    elif kind == "key_value":
        t = torch.tensor([E2M1_VALUES[c] for c in _KEY_TO_CODE], dtype=torch.float32)
    elif kind == "code_value":
        t = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    else:
        raise AssertionError(kind)
    t = t.to(device)
    _TABLES[(kind, device)] = t
    return t


def _e2m1_keys(
    x32: Tensor, *, inplace: bool = False, tmp: Tensor | None = None, shift: bool = True
) -> Tensor:
    """int32 keys in [0, 2048) of an fp32 tensor; ``_table('key_code')[key]`` is the E2M1 code.

    With ``inplace=True`` the keys overwrite ``x32``'s storage (returned as an int32 view);
    ``tmp`` is an optional int32 scratch tensor of the same shape. With ``shift=False`` the
    result is ``b + 0x1FFFFF + bit22(b)``, whose bits 21-31 are the key (for callers that extract
    them themselves). Exact for every fp32 input except NaNs whose two top payload bits are set,
    which may map to any code (callers that care fix NaNs first).
    """
    b = x32.view(torch.int32)
    t = b >> 22 if tmp is None else torch.bitwise_right_shift(b, 22, out=tmp)
    t &= 1
    if inplace:
        b += t
        t = b
    else:
        t += b
    t += 0x1FFFFF
    if shift:
        t >>= 21
        t &= 0x7FF
    return t


def e2m1_round(x: Tensor) -> Tensor:
    """Round ``x`` onto the E2M1 grid; returns uint8 codes 0..15 with the shape of ``x``.

    Round half to even, saturating at ±6; the sign bit of ``x`` is kept (``-0.0`` and tiny
    negatives give code 8); ±inf and NaN saturate to ±6 by their sign bit. Float32, bfloat16 and
    float16 inputs are rounded exactly from their own value; float64 inputs are compared in
    float64 (slower reference path).
    """
    if not x.is_floating_point():
        raise ValueError(f"e2m1_round needs a floating point tensor, got {x.dtype}")
    if x.dtype == torch.float64:
        return _e2m1_round_reference(x)
    x32 = x.float() if x.dtype != torch.float32 else x
    inf = torch.full((), float("inf"), dtype=torch.float32, device=x.device)
    x32 = torch.where(torch.isnan(x32), torch.copysign(inf, x32), x32)  # NaN -> +-inf by sign bit
    keys = _e2m1_keys(x32.contiguous(), inplace=True)
    return _table("key_code", x.device).index_select(0, keys.reshape(-1)).view(x.shape)


def _e2m1_round_reference(x: Tensor) -> Tensor:
    """Threshold-rule rounding by comparisons (any float dtype, compared in that dtype)."""
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t in _THRESHOLDS:
        code += (mag > t) if t not in _TIES_UP else (mag >= t)
    code[torch.isnan(x)] = 7
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Decode uint8 codes (0..15, high bits ignored) to their E2M1 values (exact in any float dtype)."""
    table = _table("code_value", codes.device).to(dtype)
    idx = (codes & 0xF).to(torch.int32).reshape(-1)
    return table.index_select(0, idx).view(codes.shape)


def pack_fp4(codes: Tensor) -> Tensor:
    """Pack uint8 codes ``[..., n]`` (n even) into bytes ``[..., n/2]``: element 2i low nibble, 2i+1 high."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_fp4 needs uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got shape {tuple(codes.shape)}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] & 0xF) | (pairs[..., 1] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """Unpack bytes ``[..., m]`` into uint8 codes ``[..., 2m]`` (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4 needs uint8, got {packed.dtype}")
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def check_packed_with_scales(
    fn: str, packed: Tensor, scale: Tensor, scale_dtype: torch.dtype, block: int, fmt: str
) -> tuple[list[int], int]:
    """Validate ``packed [..., out, in/2]`` against its block scales ``[..., out, in/block]``.

    Returns the leading dims and ``in/2``. Shared by the MXFP4 and NVFP4 decoders and the cast.
    """
    if packed.dtype != torch.uint8 or scale.dtype != scale_dtype:
        raise ValueError(
            f"{fn} needs uint8 packed codes and {scale_dtype} block scales, got {packed.dtype} and {scale.dtype}"
        )
    *lead, half = packed.shape
    if tuple(scale.shape[:-1]) != tuple(lead) or half != scale.shape[-1] * (block // 2):
        raise ValueError(
            f"{fmt} shapes do not match: packed {tuple(packed.shape)} needs block scales "
            f"{tuple(lead) + (half * 2 // block,)}, got {tuple(scale.shape)}"
        )
    return lead, half
