"""NVFP4 (ModelOpt Hugging Face format): scales, quantize, dequantize, fake quant.

Per weight ``W [..., out, in]`` (in % 16 == 0), docs/FORMATS.md:

- ``global_scale`` (ModelOpt ``weight_scale_2``, a dequant multiplier) = ``amax / (6 * 448)``;
- ``block_scale`` (``weight_scale``) float8_e4m3fn ``[..., out, in/16]`` = block_amax /
  (6 * global_scale), an all-zero block gets 1.0, clamped to [2**-9, 448], cast (RNE);
- codes = E2M1_round(W / (float(block_scale) * global_scale)), packed two per byte, except that
  ``-0.0`` gets code 0 (+0), not ``e2m1_round``'s 8: ModelOpt's NVFP4 export takes the sign bit from
  ``x < 0`` (``NVFP4QTensor._cast_fp4``), so exact negative zeros (a block-FP8 source's E4M3 ``0x80``)
  are written +0 while tiny negatives that round to zero keep code 8 (-0); values are unchanged;
- value = E2M1(code) * (float(block_scale) * global_scale).

Arithmetic, fixed so that every function here agrees bit for bit: everything is fp32. ``6 *
global_scale`` is rounded once, then ``block_amax / that``; ``eff = float(block_scale) *
global_scale`` is rounded once; codes round ``fp32(W) / eff``; dequantized values are
``fp32(E2M1) * eff`` rounded to fp32, then cast to the output dtype. Float64 inputs are cast to
fp32 first.

Decisions:

- ``nvfp4_global_scale(0) = 1.0`` (as if amax were 6 * 448, the uncalibrated default that
  FORMATS.md fixes for ``input_scale``): a zero scale would make the reciprocal that serving
  kernels and compressed-tensors store infinite. An all-zero weight quantizes to all-zero codes
  whatever the scale.
- A block containing NaN gets a NaN block scale (E4M3 NaN) and dequantizes to NaN; every block
  with a NaN scale (also all blocks under a NaN global scale) gets the codes +6 (bytes 0x77), so
  the bytes are the same on every device. An inf in a block clamps its
  scale to 448 and saturates to ±6.
- Leading batch dims: ``global_scale`` may be a scalar (shape ``[]`` or ``[1]``), or have one
  value per leading index (shape ``[E]`` or ``[E, 1, 1]`` for ``W [E, out, in]``; in general
  anything broadcastable to ``W.shape[:-1] + (1,)``). ``nvfp4_quantize(W)`` with no global scale
  uses one per leading index of a batched ``W`` (per expert), one scalar for a 2-D ``W``.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
from torch import Tensor

from ._slabs import run_slabs
from .constants import FP4_MAX, FP8_E4M3_MAX, FP8_E4M3_MIN_SUBNORMAL, NVFP4_BLOCK
from .e2m1 import _e2m1_keys, _table, check_packed_with_scales

__all__ = [
    "FP4_MAX",
    "FP8_E4M3_MAX",
    "NVFP4Weight",
    "nvfp4_block_scales",
    "nvfp4_dequantize",
    "nvfp4_fake_quant",
    "nvfp4_global_scale",
    "nvfp4_quantize",
]

_E4M3 = torch.float8_e4m3fn
_PAIR_TABLES: dict[tuple, Tensor] = {}


class NVFP4Weight(NamedTuple):
    """A packed NVFP4 weight (ModelOpt tensor names in brackets).

    packed: uint8 ``[..., out, in/2]`` E2M1 codes, element 2i in the low nibble (``weight``).
    block_scale: float8_e4m3fn ``[..., out, in/16]`` (``weight_scale``).
    global_scale: float32 ``[]`` or one per leading index, e.g. ``[E]`` (``weight_scale_2``).
    """

    packed: Tensor
    block_scale: Tensor
    global_scale: Tensor


def nvfp4_global_scale(amax: Tensor | float) -> Tensor:
    """``amax / (6 * 448)`` in fp32 (same shape as ``amax``); amax == 0 gives 1.0."""
    amax = torch.as_tensor(amax).float()
    # divide by a tensor on amax's device: CUDA turns division by a Python scalar into a
    # multiplication by its reciprocal, which rounds differently
    return torch.where(amax == 0, 1.0, amax / amax.new_tensor(FP4_MAX * FP8_E4M3_MAX))


def _check_blocks(x: Tensor, what: str) -> None:
    if not x.is_floating_point() or x.dim() == 0 or x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(
            f"{what} needs a float tensor whose last dim is a multiple of {NVFP4_BLOCK}, "
            f"got {x.dtype} {tuple(x.shape)}"
        )


def _rows_global_scale(global_scale: Tensor | float, shape: torch.Size, device: torch.device) -> Tensor:
    """The global scale as fp32, either a 0-d tensor or one value per row ``[R, 1]`` of ``shape``."""
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=device)
    if gs.numel() == 1:
        return gs.reshape(())
    lead = tuple(shape[:-1])
    if gs.dim() == 1 and len(lead) >= 2 and gs.shape[0] == lead[0]:
        gs = gs.reshape((-1,) + (1,) * (len(shape) - 1))
    try:
        rows = gs.expand(lead + (1,))
    except RuntimeError:
        raise ValueError(
            f"global_scale of shape {tuple(gs.shape)} does not broadcast to a tensor of shape {tuple(shape)} "
            "(use a scalar, [E] or [E, 1, 1] for [E, out, in])"
        ) from None
    return rows.reshape(-1, 1)


def _leading_amax(block_amax: Tensor, lead: tuple[int, ...]) -> Tensor:
    """Tensor amax from block amaxes ``[R, nb]``: one per leading index for batched weights."""
    if len(lead) <= 1:
        return block_amax.amax()
    return block_amax.view(*lead[:-1], -1).amax(dim=-1)


_SIGNLESS = {
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFFFFFF),
}


def _block_amax(xb: Tensor) -> Tensor:
    """fp32 amax over the last dim. Compares sign-cleared bit patterns (monotone for floats, and a
    NaN pattern beats inf as torch.amax propagates NaN): several times faster than amax on CPU."""
    signless = _SIGNLESS.get(xb.dtype)
    if signless is None:
        return xb.abs().amax(dim=-1).float()
    int_dtype, mask = signless
    return (xb.view(int_dtype) & mask).amax(dim=-1).view(xb.dtype).float()


def _scales_from_amax(amax: Tensor, denom: Tensor, out: Tensor | None = None) -> Tensor:
    """E4M3 block scales ``amax / denom`` (``denom = 6 * gs``, rounded once), all-zero block 1.0,
    clamped to [2**-9, 448]; written into ``out`` (e4m3) when given."""
    bs = amax / denom
    bs.masked_fill_(amax == 0, 1.0).clamp_(FP8_E4M3_MIN_SUBNORMAL, FP8_E4M3_MAX)
    return bs.to(_E4M3) if out is None else out.copy_(bs)


def _quantize_keys(
    xb: Tensor,
    gs: Tensor,
    bs: Tensor | None = None,
    scratch: tuple[Tensor, Tensor] | None = None,
    shift: bool = True,
    unsigned_zero: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """(E2M1 table keys int32 [R, nb, 16], block scales e4m3 [R, nb], eff fp32 [R, nb, 1]).

    ``scratch`` = (fp32, int32) buffers of ``xb``'s shape: the keys are written into the first
    (unshifted with ``shift=False``, see ``_e2m1_keys``). ``unsigned_zero``: ``-0.0`` gets code 0, not 8
    (the module docstring's sign rule; tiny negatives that round to zero keep code 8).
    """
    if bs is None:
        bs = _scales_from_amax(_block_amax(xb), gs * FP4_MAX)
    eff = (bs.float() * gs).unsqueeze(-1)
    if scratch is None:
        q = torch.div(xb, eff)  # fp32 (bf16/fp16 inputs are promoted exactly)
    else:
        q, tmp = scratch
        torch.div(xb, eff, out=q)
    if unsigned_zero:
        q += 0.0  # IEEE: -0.0 + 0.0 = +0.0, every other value (and its sign) unchanged
    if scratch is None:
        return _e2m1_keys(q, inplace=True), bs, eff
    return _e2m1_keys(q, inplace=True, tmp=tmp, shift=shift), bs, eff


def _scratch(rows: int, nb: int, device: torch.device) -> tuple[Tensor, Tensor]:
    shape = (rows, nb, NVFP4_BLOCK)
    return torch.empty(shape, dtype=torch.float32, device=device), torch.empty(
        shape, dtype=torch.int32, device=device
    )


def _pair_code_table(device: torch.device) -> Tensor:
    """[2**22] uint8: entry ``k0 | k1 << 11`` is the packed byte of the E2M1 keys k0 (low) and k1."""
    t = _PAIR_TABLES.get(("pair_code", device))
    if t is None:
        codes = _table("key_code", device)
        # row k1, column k0: index k1 * 2048 + k0 == k0 | k1 << 11. An outer op builds the 4 MiB table
        # directly (indexing an int64 arange of 2**22 would peak ~75 MiB of temporaries).
        t = (codes[None, :] | (codes[:, None] << 4)).reshape(-1)
        _PAIR_TABLES[("pair_code", device)] = t
    return t


def _pack_keys(sums: Tensor, tmp: Tensor, out: Tensor) -> None:
    """Packed bytes into ``out [..., m]`` from contiguous int32 unshifted keys ``[..., 2m]``.

    ``sums`` come from ``_e2m1_keys(..., shift=False)`` (key = bits 21-31) and are clobbered;
    ``tmp`` is int32 scratch of the same size. Read as int64 pairs (little endian), the even
    element's key is bits 21-31 and the odd one's bits 53-63: both go into one 22-bit index.
    """
    v = sums.view(torch.int64).view(-1)
    u = tmp.view(-1)[: 2 * v.numel()].view(torch.int64)
    torch.bitwise_right_shift(v, 21, out=u)
    u &= 0x7FF  # even key
    v >>= 42
    v &= 0x3FF800  # odd key << 11
    u |= v
    torch.index_select(_pair_code_table(sums.device), 0, u, out=out.view(-1))


def nvfp4_block_scales(w: Tensor, global_scale: Tensor | float) -> Tensor:
    """Per-16-block scales ``block_amax / (6 * global_scale)`` as float8_e4m3fn ``[..., in/16]``.

    An all-zero block gets 1.0; the result is clamped to [2**-9, 448] before the (RNE) cast.
    """
    _check_blocks(w, "nvfp4_block_scales")
    if w.dtype == torch.float64:
        w = w.float()
    *lead, n = w.shape
    gs = _rows_global_scale(global_scale, w.shape, w.device)
    amax = _block_amax(w.reshape(-1, n // NVFP4_BLOCK, NVFP4_BLOCK))
    return _scales_from_amax(amax, gs * FP4_MAX).view(*lead, n // NVFP4_BLOCK)


def nvfp4_quantize(
    w: Tensor, global_scale: Tensor | float | None = None, block_scale: Tensor | None = None
) -> NVFP4Weight:
    """Quantize ``w [..., out, in]`` to NVFP4 (see the module docstring for the exact arithmetic).

    ``global_scale`` (``weight_scale_2``) defaults to ``nvfp4_global_scale(amax)`` with the amax
    taken per leading index for batched weights (``[E, out, in]`` -> ``[E]``). ``block_scale``
    (float8_e4m3fn ``[..., out, in/16]``): block scales chosen elsewhere (a calibrator's search),
    used instead of the amax-derived ones; ``global_scale`` is then required.
    """
    _check_blocks(w, "nvfp4_quantize")
    w = w.detach()
    if w.dtype == torch.float64:
        w = w.float()
    if sys.byteorder != "little":  # _pack_keys reads int32 pairs as int64
        raise NotImplementedError("nvfp4_quantize assumes a little-endian host")
    *lead, n = w.shape
    nb = n // NVFP4_BLOCK
    x = w.reshape(-1, nb, NVFP4_BLOCK)
    device = w.device
    given = _given_block_scale(block_scale, global_scale, x.shape[:2], device)
    if global_scale is None:
        amax = torch.empty(x.shape[0], nb, dtype=torch.float32, device=device)

        def block_amax(sl: slice) -> None:
            amax[sl] = _block_amax(x[sl])

        run_slabs(x.shape[0], n, device, block_amax)
        global_scale = nvfp4_global_scale(_leading_amax(amax, tuple(lead)))
    else:
        amax = None
    global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=device)
    if global_scale.numel() == 1:
        global_scale = global_scale.reshape(())
    gs = _rows_global_scale(global_scale, w.shape, device)
    denom = gs * FP4_MAX
    packed = torch.empty(x.shape[0], n // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(x.shape[0], nb, dtype=_E4M3, device=device)
    _pair_code_table(device)  # build the shared tables before any worker thread needs them

    def quantize(sl: slice) -> None:
        xs, g = x[sl], gs[sl] if gs.dim() else gs
        a = _block_amax(xs) if amax is None else amax[sl]
        bs = scales[sl]
        if given is None:
            _scales_from_amax(a, denom[sl] if denom.dim() else denom, out=bs)
        else:
            bs.copy_(given[sl])
        q, tmp = _scratch(xs.shape[0], nb, device)
        sums, _, _ = _quantize_keys(xs, g, bs, (q, tmp), shift=False, unsigned_zero=True)
        _pack_keys(sums, tmp, packed[sl])
        _saturate_nan_blocks(packed[sl].view(-1, nb, NVFP4_BLOCK // 2), _e4m3_isnan(bs))

    run_slabs(x.shape[0], n, device, quantize)
    return NVFP4Weight(packed.view(*lead, n // 2), scales.view(*lead, nb), global_scale)


def _given_block_scale(
    block_scale: Tensor | None, global_scale, rows_nb: tuple[int, int], device: torch.device
) -> Tensor | None:
    """``block_scale`` as e4m3 ``[R, nb]`` on ``device`` (None stays None), shape-checked."""
    if block_scale is None:
        return None
    if global_scale is None:
        raise ValueError("a given block_scale needs its global_scale (the scales were chosen under it)")
    if block_scale.dtype != _E4M3 or block_scale.numel() != rows_nb[0] * rows_nb[1]:
        raise ValueError(f"block_scale must be float8_e4m3fn with {rows_nb[0]}x{rows_nb[1]} blocks, "
                         f"got {block_scale.dtype} {tuple(block_scale.shape)}")
    return block_scale.reshape(rows_nb).to(device)


def _e4m3_isnan(bs: Tensor) -> Tensor:
    return (bs.view(torch.uint8) & 0x7F) == 0x7F


def _saturate_nan_blocks(block_bytes: Tensor, nan: Tensor) -> None:
    """Give every block whose scale is NaN the codes +6 (bytes 0x77), in place.

    The codes do not change such a block's (NaN) value, but the quotients' NaN payloads differ
    between devices; a fixed code keeps the bytes reproducible.
    """
    if block_bytes.device.type == "cpu" and not bool(nan.any()):
        return
    block_bytes.masked_fill_(nan.view(*block_bytes.shape[:-1], 1), 0x77)


def nvfp4_dequantize(
    packed: Tensor, block_scale: Tensor, global_scale: Tensor | float, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``E2M1(code) * (float(block_scale) * global_scale)`` as ``[..., out, in]`` in ``dtype``."""
    lead, half = check_packed_with_scales("nvfp4_dequantize", packed, block_scale, _E4M3, NVFP4_BLOCK, "NVFP4")
    nb = block_scale.shape[-1]
    n = half * 2
    device = packed.device
    gs = _rows_global_scale(global_scale, torch.Size((*lead, n)), device)
    pair_values = _byte_pair_values(device)
    rows = packed.reshape(-1, nb, NVFP4_BLOCK // 2)
    srows = block_scale.reshape(-1, nb)
    out = torch.empty(rows.shape[0], nb, NVFP4_BLOCK, dtype=dtype, device=device)

    def dequantize(sl: slice) -> None:
        vals = pair_values.index_select(0, rows[sl].reshape(-1).int()).view(torch.float32)
        vals = vals.view(-1, nb, NVFP4_BLOCK)
        vals *= (srows[sl].float() * (gs[sl] if gs.dim() else gs)).unsqueeze(-1)
        out[sl] = vals

    run_slabs(rows.shape[0], n, device, dequantize)
    return out.view(*lead, n)


def _byte_pair_values(device: torch.device) -> Tensor:
    """[256] int64 table: both fp32 E2M1 values of a packed byte, bit-packed (low nibble first)."""
    key = ("byte_pair_fp32", device)
    t = _PAIR_TABLES.get(key)
    if t is None:
        vals = _table("code_value", torch.device("cpu"))
        byte = torch.arange(256)
        t = torch.stack((vals[byte & 0xF], vals[byte >> 4]), dim=-1).contiguous().view(torch.int64)
        t = t.reshape(-1).to(device)
        _PAIR_TABLES[key] = t
    return t


def nvfp4_fake_quant(x: Tensor, global_scale: Tensor | float, block_scale: Tensor | None = None) -> Tensor:
    """Quantize-dequantize ``x [..., n]`` (n % 16 == 0) in blocks of 16 along the last dim.

    Block scales are dynamic (computed from ``x``) unless ``block_scale`` gives them (e4m3
    ``[..., n/16]``, a calibrator's choice), the global scale is the one given (scalar, or
    one per leading index as for weights). Returns ``x.dtype``; equals
    ``nvfp4_dequantize(*nvfp4_quantize(x, global_scale, block_scale), dtype=x.dtype)`` bit for
    bit. No gradient flows (calibration use).
    """
    _check_blocks(x, "nvfp4_fake_quant")
    x = x.detach()
    out_dtype = x.dtype
    if x.dtype == torch.float64:
        x = x.float()
    n = x.shape[-1]
    nb = n // NVFP4_BLOCK
    gs = _rows_global_scale(global_scale, x.shape, x.device)
    xb = x.reshape(-1, nb, NVFP4_BLOCK)
    device = x.device
    given = _given_block_scale(block_scale, global_scale, xb.shape[:2], device)
    out = torch.empty(xb.shape, dtype=out_dtype, device=device)
    key_value = _table("key_value", device)

    def fake_quant(sl: slice) -> None:
        xs = xb[sl]
        q, tmp = _scratch(xs.shape[0], nb, device)
        keys, _, eff = _quantize_keys(xs, gs[sl] if gs.dim() else gs, None if given is None else given[sl], (q, tmp),
                                      unsigned_zero=True)
        vals = tmp.view(torch.float32)
        torch.index_select(key_value, 0, keys.view(-1), out=vals.view(-1))
        if out_dtype == torch.float32:
            torch.mul(vals, eff, out=out[sl])
        else:
            vals *= eff
            out[sl] = vals

    run_slabs(xb.shape[0], n, device, fake_quant)
    return out.view(x.shape)
