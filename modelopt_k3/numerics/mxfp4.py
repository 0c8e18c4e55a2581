"""MXFP4 (compressed-tensors "mxfp4-pack-quantized"): decode and OCP-MX encode.

Layout (docs/FORMATS.md): ``weight_packed`` uint8 ``[..., out, in/2]`` (E2M1 codes, element 2i in
the low nibble) and ``weight_scale`` uint8 ``[..., out, in/32]`` of E8M0 exponents;
``w[r, c] = E2M1(code[r, c]) * 2 ** (weight_scale[r, c // 32] - 127)``.

Decisions:

- Scale byte 255 is NaN (OCP MX E8M0); its block decodes to NaN. (compressed-tensors computes
  ``2.0 ** 128`` there, i.e. inf, and 0 * inf = NaN for zero codes.) Bytes 0..254 decode exactly,
  including ``2**-127``; a product beyond the dtype's range becomes inf, as in compressed-tensors.
- Decoding is one gather from a cached 256x256 table indexed by ``(scale_byte, packed_byte)``
  whose entry holds both decoded elements of the byte, so a byte costs one load.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._slabs import run_slabs
from .constants import E2M1_EMAX, E8M0_BIAS, E8M0_MAX_EXP, E8M0_MIN_EXP, E8M0_NAN, MXFP4_BLOCK
from .e2m1 import E2M1_VALUES, _e2m1_keys, _table, check_packed_with_scales, pack_fp4

__all__ = ["e8m0_to_float", "mxfp4_decode", "mxfp4_encode"]

_PAIR_INT = {2: torch.int32, 4: torch.int64}
_DECODE_TABLES: dict[tuple, Tensor] = {}


def e8m0_to_float(scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """E8M0 bytes to ``2 ** (s - 127)`` in ``dtype`` (byte 255 -> NaN)."""
    return _scale_table(scale.device).to(dtype).index_select(0, scale.reshape(-1).int()).view(scale.shape)


def _scale_table(device: torch.device) -> Tensor:
    key = ("e8m0", device)
    t = _DECODE_TABLES.get(key)
    if t is None:
        exps = torch.arange(256, dtype=torch.float64) - E8M0_BIAS
        t = torch.exp2(exps).float()  # exact powers of two, 2**-127 is an fp32 subnormal
        t[E8M0_NAN] = float("nan")
        t = t.to(device)
        _DECODE_TABLES[key] = t
    return t


def _pair_table(dtype: torch.dtype, device: torch.device) -> Tensor:
    """[256 * 256] table: entry ``s << 8 | byte`` holds both decoded elements of ``byte``, bit-packed."""
    key = ("pair", dtype, device)
    t = _DECODE_TABLES.get(key)
    if t is None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        if itemsize not in _PAIR_INT:
            raise ValueError(f"mxfp4_decode does not support dtype {dtype}")
        byte = torch.arange(256)
        vals = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        lo, hi = vals[byte & 0xF], vals[byte >> 4]
        scale = _scale_table(torch.device("cpu"))[:, None]
        # E2M1 value times a power of two is exact in fp32 (or overflows to inf); one cast to dtype.
        pairs = torch.stack((lo[None, :] * scale, hi[None, :] * scale), dim=-1).to(dtype)
        t = pairs.contiguous().view(_PAIR_INT[itemsize]).reshape(-1).to(device)
        _DECODE_TABLES[key] = t
    return t


def mxfp4_decode(
    weight_packed: Tensor, weight_scale: Tensor, dtype: torch.dtype = torch.bfloat16, *, out: Tensor | None = None
) -> Tensor:
    """Decode MXFP4 to ``[..., out, in]`` in ``dtype`` (bit-exact; leading batch dims allowed).

    ``weight_packed`` uint8 ``[..., out, in/2]``, ``weight_scale`` uint8 ``[..., out, in/32]``.
    ``out``: a contiguous ``dtype`` tensor of the result's shape to decode into (a reusable
    workspace); returned.
    """
    lead, half = check_packed_with_scales("mxfp4_decode", weight_packed, weight_scale, torch.uint8, MXFP4_BLOCK, "MXFP4")
    n_blocks = weight_scale.shape[-1]
    table = _pair_table(dtype, weight_packed.device)
    rows = weight_packed.reshape(-1, n_blocks, MXFP4_BLOCK // 2)
    srows = weight_scale.reshape(-1, n_blocks, 1)
    shape = (*lead, half * 2)
    if out is None:
        pairs = torch.empty(rows.shape, dtype=table.dtype, device=weight_packed.device)
    else:
        if out.dtype != dtype or tuple(out.shape) != shape or not out.is_contiguous() or out.device != weight_packed.device:
            raise ValueError(
                f"mxfp4_decode: out must be a contiguous {dtype} tensor of shape {list(shape)} on "
                f"{weight_packed.device}, got {out.dtype} {list(out.shape)} on {out.device}"
            )
        pairs = out.view(table.dtype).view(rows.shape)

    def decode(sl: slice) -> None:
        idx = torch.bitwise_or(srows[sl].int() << 8, rows[sl])
        torch.index_select(table, 0, idx.view(-1), out=pairs[sl].view(-1))

    run_slabs(rows.shape[0], half, weight_packed.device, decode)
    return out if out is not None else pairs.view(dtype).view(shape)


def mxfp4_encode(w: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize ``w [..., out, in]`` (in % 32 == 0) to MXFP4 following the OCP MX v1.0 rule.

    Per block of 32: shared exponent ``e = floor(log2(block_amax)) - 2`` (2 = floor(log2(6)), the
    E2M1 emax), clamped to the E8M0 range [-127, 127]; codes = E2M1_round(w / 2**e) (computed in
    fp32, saturating at ±6, so magnitudes in [6, 8) * 2**e clip to 6). An all-zero block gets
    e = -127 (byte 0); a block holding NaN gets byte 255 (NaN) and codes +6 (bytes 0x77).
    Note: compressed-tensors' observer rounds the amax to a power of two *up* when its mantissa
    is large (``round_to_power_2``), so its exponents can be one higher than OCP's for some
    blocks; this function is the OCP rule.

    Returns ``(weight_packed uint8 [..., out, in/2], weight_scale uint8 [..., out, in/32])``.
    """
    if not w.is_floating_point() or w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(
            f"mxfp4_encode needs a float tensor with last dim % 32 == 0, got {w.dtype} {tuple(w.shape)}"
        )
    *lead, n = w.shape
    wb = w.reshape(*lead, n // MXFP4_BLOCK, MXFP4_BLOCK).float()
    amax = wb.abs().amax(dim=-1)
    _, exp = torch.frexp(amax)  # amax = m * 2**exp, m in [0.5, 1): floor(log2(amax)) = exp - 1
    e = (exp - 1 - E2M1_EMAX).clamp_(E8M0_MIN_EXP, E8M0_MAX_EXP)
    e = torch.where(amax == 0, E8M0_MIN_EXP, e)
    e = torch.where(torch.isinf(amax), E8M0_MAX_EXP, e)
    scale = (e + E8M0_BIAS).to(torch.uint8)
    scale = torch.where(torch.isnan(amax), E8M0_NAN, scale).to(torch.uint8)
    # 2**-e from the exact E8M0 table (2**127 .. 2**-127), so x * inv == x / 2**e exactly
    inv = _scale_table(w.device).index_select(0, (E8M0_BIAS - e).reshape(-1).int()).view(e.shape)
    q = wb * inv.unsqueeze(-1)
    keys = _e2m1_keys(q, inplace=True)
    codes = _table("key_code", w.device).index_select(0, keys.reshape(-1)).view(*lead, n)
    packed = pack_fp4(codes)
    # NaN blocks decode to NaN whatever their codes; fix them to +6 so bytes match across devices
    packed.view(*lead, n // MXFP4_BLOCK, MXFP4_BLOCK // 2).masked_fill_(torch.isnan(amax).unsqueeze(-1), 0x77)
    return packed, scale
