"""Calibration-free MXFP4 -> NVFP4 cast (docs/FORMATS.md, "Calibration-free MXFP4 -> NVFP4").

An MXFP4 block of 32 is two NVFP4 blocks of 16 sharing one power-of-two scale ``2**(s-127)``.
With ``weight_scale_2 = gs`` a power of two, the NVFP4 block scale ``2**(s-127) / gs`` is a power
of two too, and E4M3 holds the powers of two ``2**-9`` (subnormal) .. ``2**8``. When it is
representable the E2M1 codes carry over byte for byte and the block is lossless.

Why the largest block maps to 2**8 = 256 and not 448: block scales must be *powers of two* for the
codes to carry over, and 256 is the largest power of two in E4M3 (448 = 1.75 * 2**8 is not).
FORMATS.md's "at most 448" is met with the most headroom downward: 18 consecutive exponents
(``max_s - 17 .. max_s``) are lossless.

Rules (all vectorized, on the uint8 exponents and bytes directly):

- Default ``global_scale`` = ``shared_global_scale_for(weight_scale)``: ``2**(max_s - 127 - 8)``
  over every block with ``s != 255`` (per leading index for batched ``[E, out, in/32]``).
  ``shared_global_scale_for(w1_scale, w3_scale)`` is the max over both, so an expert's gate and
  up projections share it (the scale tensors alone cannot tell all-zero blocks apart, so their
  exponents count; encoders give zero blocks small exponents, which never raise the max).
- A block is carried when ``fp32(e4m3(2**(s-127) / gs)) * gs == 2**(s-127)`` exactly in fp32 (the
  same product ``nvfp4_dequantize`` forms), so any ``global_scale`` the caller passes works; only
  a power of two carries every in-range block.
- An NVFP4 half-block whose 16 codes are all ±0 is carried with block scale 1.0 (the NVFP4
  all-zero rule) and never counted, whatever its exponent.
- Any other half-block is requantized from its decoded fp32 values with the NVFP4 numerics of
  ``nvfp4_quantize`` and the same global scale, and counted. This covers exponents below
  ``2**-9 * gs`` (the block scale clamps to 2**-9), above 448 * gs (only with a caller-chosen
  global scale) and E8M0 NaN (byte 255: NaN block scale and codes +6, decodes to NaN as MXFP4
  does). Below-range blocks under a power-of-two global scale (the common case) take a shortcut
  with the same result: their scale clamps to 2**-9 and their E2M1 values scale by exactly 2**-k,
  so new bytes come from a ``[6, 256]`` byte table; only the rest decode and requantize.
- Zero signs: a carried block keeps its ``-0`` codes (code 8 decodes to ``-0.0``, as ``mxfp4_decode``
  gives); a requantized or shifted one writes an exact ``-0.0`` as code 0, as ``nvfp4_quantize`` does
  (ModelOpt's sign rule, numerics/nvfp4.py).

For every carried block ``nvfp4_dequantize(result)`` equals ``mxfp4_decode`` bit for bit (in fp32
and, as both round the same fp32 value once, in bf16).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor

from ._slabs import run_slabs
from .constants import (
    E8M0_BIAS,
    E8M0_NAN,
    FP8_E4M3_MAX_POW2_EXP,
    FP8_E4M3_MIN_POW2_EXP,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
)
from .e2m1 import E2M1_VALUES, _table, check_packed_with_scales, e2m1_round, pack_fp4, unpack_fp4
from .mxfp4 import _scale_table
from .nvfp4 import NVFP4Weight, _quantize_keys, _rows_global_scale, _saturate_nan_blocks

__all__ = ["mxfp4_to_nvfp4", "shared_global_scale_for"]

_E4M3 = torch.float8_e4m3fn
_E4M3_ONE = 0x38  # float8_e4m3fn bit pattern of 1.0
_E4M3_MIN = 0x01  # float8_e4m3fn bit pattern of 2**-9
_MAG_BITS = 0x7777777777777777  # the three magnitude bits of all 16 nibbles in 8 bytes
_MAX_SHIFT = 5  # 6 * 2**-5 < 0.25: from 5 binades down every E2M1 value rounds to +-0
_SHIFT_TABLES: dict[torch.device, Tensor] = {}


def _halves(x: Tensor) -> Tensor:
    """uint8 ``[R, 2n]`` repeating each value (0..255) of ``x [R, n]`` twice (per-32 to per-16 block)."""
    x16 = x.to(torch.int16)
    x16 |= x16 << 8
    return x16.view(torch.uint8)


class _BlockRules(NamedTuple):
    """Per (global scale, exponent byte) tables, ``[len(gs) * 256]`` each (see ``mxfp4_to_nvfp4``)."""

    bits2: Tensor  # int16: e4m3 bits of the block scale, twice (one per 16-half), little end first
    shift: Tensor  # int32: shift row k << 8 (0 = codes carried unchanged)
    shifted2: Tensor  # int16: 1 for shifted blocks, twice
    general: Tensor  # uint8: 1 where the block is requantized from its decoded values


def _block_rules(gs: Tensor) -> _BlockRules:
    gs = gs.view(-1, 1)
    s = torch.arange(256, device=gs.device).view(1, -1)
    target = _scale_table(gs.device).view(1, -1)  # 2**(s-127) fp32, NaN for 255
    cand = (target / gs).to(_E4M3)
    carried = cand.float() * gs == target  # NaN compares False
    # Below-range blocks under a power-of-two global scale 2**g: the NVFP4 rule clamps their scale
    # to 2**-9 and divides the decoded value code * 2**(s-127) by 2**-9 * 2**g, i.e. scales the E2M1
    # value by exactly 2**-k, k = g + 118 - s >= 1: new codes are a table lookup on the old bytes.
    mant, exp = torch.frexp(gs)
    k = (exp - 1 + (E8M0_BIAS + FP8_E4M3_MIN_POW2_EXP)) - s
    shifted = (mant == 0.5) & (k >= 1) & (s != E8M0_NAN) & ~carried
    general = ~(carried | shifted)
    bits = cand.view(torch.uint8).int().masked_fill(shifted, _E4M3_MIN)
    row = k.clamp(0, _MAX_SHIFT).masked_fill(~shifted, 0).int()
    twice = 0x0101  # x * 0x0101 = x | x << 8 for a byte x; as int16 bits
    return _BlockRules(
        bits2=(bits * twice).short().view(-1),
        shift=(row << 8).view(-1),
        shifted2=(shifted.int() * twice).short().view(-1),
        general=general.to(torch.uint8).view(-1),
    )


def _shift_table(device: torch.device) -> Tensor:
    """[(_MAX_SHIFT + 1) * 256] uint8: entry ``k << 8 | byte`` re-rounds both codes of ``byte`` scaled by 2**-k."""
    t = _SHIFT_TABLES.get(device)
    if t is None:
        codes = unpack_fp4(torch.arange(256, dtype=torch.uint8))  # [512], low nibble first
        vals = torch.tensor(E2M1_VALUES)[codes.int()]
        # Row 0 carries the bytes as they are (a carried -0 stays -0); a re-rounded -0.0 gets code 0 (+ 0.0), as
        # nvfp4_quantize writes it (numerics/nvfp4.py), while -0.5 * 2**-k that rounds to zero stays code 8.
        rows = [torch.arange(256, dtype=torch.uint8)]
        rows += [pack_fp4(e2m1_round(vals * 2.0**-k + 0.0)) for k in range(1, _MAX_SHIFT + 1)]
        t = torch.cat(rows).to(device)
        _SHIFT_TABLES[device] = t
    return t


def shared_global_scale_for(*weight_scales: Tensor) -> Tensor:
    """Power-of-two ``weight_scale_2`` mapping the largest block scale of all inputs to 2**8.

    ``weight_scales`` are MXFP4 E8M0 scale tensors ``[..., out, in/32]`` (e.g. an expert's w1 and
    w3). 2-D inputs give a 0-d fp32 tensor; batched ``[E, out, in/32]`` inputs give ``[E]`` (one
    per leading index), and all inputs must share those leading dims. Bytes 255 (NaN) are ignored.
    """
    if not weight_scales:
        raise ValueError("shared_global_scale_for needs at least one weight_scale tensor")
    lead = tuple(weight_scales[0].shape[:-2])
    smax = None
    for s in weight_scales:
        if s.dtype != torch.uint8 or s.dim() < 2 or tuple(s.shape[:-2]) != lead:
            raise ValueError(
                f"shared_global_scale_for needs uint8 [..., out, in/32] tensors with equal leading dims; "
                f"got {s.dtype} {tuple(s.shape)} next to leading dims {lead}"
            )
        if s.numel():
            m = _max_exponent(s, lead)
        else:
            m = torch.zeros(lead, dtype=torch.uint8, device=s.device)
        smax = m if smax is None else torch.maximum(smax, m)
    exp = smax.double() - (E8M0_BIAS + FP8_E4M3_MAX_POW2_EXP)
    return torch.exp2(exp).float()  # 2**-135 .. 2**119, exact in fp32


def _max_exponent(weight_scale: Tensor, lead: tuple[int, ...]) -> Tensor:
    """uint8 ``lead``: the largest exponent byte per leading index, NaN bytes (255) ignored (0 when all are).

    One vectorized reduction over each leading index's bytes: ``s + 1`` wraps 255 (NaN) to 0 in uint8,
    so ``max(s + 1) - 1`` is the largest other byte (E8M0_NAN is 255; a compare and mask costs 30x the max)."""
    top = (weight_scale.reshape(*lead, -1) + 1).amax(dim=-1)
    return top.clamp_(min=1) - 1


def mxfp4_to_nvfp4(
    weight_packed: Tensor, weight_scale: Tensor, global_scale: Tensor | float | None = None, *,
    share_codes: bool = False,
) -> tuple[NVFP4Weight, int]:
    """Cast MXFP4 ``(weight_packed [..., out, in/2], weight_scale [..., out, in/32])`` to NVFP4.

    Returns ``(NVFP4Weight(packed, block_scale, global_scale), n_requantized_blocks)``, where
    blocks are NVFP4 blocks of 16 and ``global_scale`` is ModelOpt's ``weight_scale_2``
    (value = code * float(block_scale) * global_scale). See the module docstring for the rules.
    ``share_codes``: when every code byte carries over unchanged, ``packed`` is a view of (a
    contiguous) ``weight_packed`` itself, not a copy (the converter then neither copies nor
    re-hashes them); the caller must not modify either afterwards.
    """
    lead, half = check_packed_with_scales("mxfp4_to_nvfp4", weight_packed, weight_scale, torch.uint8, MXFP4_BLOCK, "MXFP4")
    device = weight_packed.device
    if global_scale is None:
        global_scale = shared_global_scale_for(weight_scale)
    global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=device)
    gs = _rows_global_scale(global_scale, torch.Size((*lead, half * 2)), device)
    s = weight_scale.reshape(-1, weight_scale.shape[-1])
    src = weight_packed.reshape(-1, s.shape[1], MXFP4_BLOCK // 2).contiguous()
    tables = _cast_tables(gs)
    out, n_req, any_general = _carry_blocks(src, s, tables, share_codes)
    if any_general:  # NaN exponents, a non-power-of-two or too small caller-given global scale
        n_req += _requantize_general(out, s, gs, tables)
    result = NVFP4Weight(out.packed.view(*lead, half), out.bits.view(_E4M3).view(*lead, 2 * s.shape[1]), global_scale)
    return result, n_req


class _CastTables(NamedTuple):
    """What every block's outcome is looked up in (see ``mxfp4_to_nvfp4``)."""

    rules: _BlockRules  # per (distinct global scale, exponent byte)
    row_offset: Tensor | None  # int32 [R, 1]: each row's global scale id << 8 (None: one global scale)
    shift_table: Tensor  # re-rounded code bytes of below-range blocks (``_shift_table``)


class _CastOut(NamedTuple):
    """The cast's outputs, filled slab by slab."""

    packed: Tensor  # uint8 [R, in/2]: the E2M1 code bytes
    bits: Tensor  # uint8 [R, in/16]: the e4m3 bits of the NVFP4 block scales
    zero: Tensor  # bool [R, in/16]: half-blocks whose 16 codes are all +-0


def _cast_tables(gs: Tensor) -> _CastTables:
    """Every per-block decision depends only on (global scale, exponent byte): tabulate it for the
    distinct global scales, instead of doing fp math on every block."""
    uniq, inverse = torch.unique(gs.reshape(-1), return_inverse=True)
    row_offset = (inverse.view(-1, 1).int() << 8) if uniq.numel() > 1 else None
    return _CastTables(_rules_for(uniq), row_offset, _shift_table(gs.device))


_RULES_CACHE: dict[tuple[torch.device, tuple[float, ...]], _BlockRules] = {}
_RULES_CACHE_MAX = 256


def _rules_for(uniq: Tensor) -> _BlockRules:
    """``_block_rules(uniq)``, remembered per (device, global scale values): a checkpoint's power-of-two
    global scales take few values, and tabulating them again costs more than a small tensor's cast."""
    key = (uniq.device, tuple(uniq.tolist()))
    rules = _RULES_CACHE.get(key)
    if rules is None:
        rules = _block_rules(uniq)
        if len(_RULES_CACHE) >= _RULES_CACHE_MAX:
            _RULES_CACHE.clear()
        _RULES_CACHE[key] = rules
    return rules


def _rule_index(s: Tensor, row_offset: Tensor | None) -> Tensor:
    """int32, flat: each block's index into the rule tables, ``global scale id << 8 | exponent byte``."""
    return (s.int() if row_offset is None else row_offset | s).view(-1)


def _carry_blocks(src: Tensor, s: Tensor, tables: _CastTables, share_codes: bool = False) -> tuple[_CastOut, int, bool]:
    """Carried and below-range (shifted) blocks, all rows: ``(outputs, shifted blocks that are not all
    zero, whether any block must be requantized from its decoded values)``. ``share_codes``: slabs whose
    codes carry are not copied at once; if every slab carries and no block is requantized, ``packed``
    is ``src`` itself, else those slabs are copied afterwards (the bytes are the same either way)."""
    n_rows, n_half = src.shape[0], 2 * s.shape[1]
    device = src.device
    out = _CastOut(
        torch.empty(n_rows, n_half * NVFP4_BLOCK // 2, dtype=torch.uint8, device=device),
        torch.empty(n_rows, n_half, dtype=torch.uint8, device=device),
        torch.empty(n_rows, n_half, dtype=torch.bool, device=device),
    )
    shifted_counts: list[Tensor] = []
    general_slabs: list[bool] = []
    deferred: list[slice] | None = [] if share_codes else None
    slab = partial(_carry_slab, src, s, tables, out, shifted_counts, general_slabs, deferred)
    run_slabs(n_rows, out.packed.shape[1], device, slab)
    any_general = any(general_slabs)
    if deferred is not None:
        if not shifted_counts and not any_general:
            out = out._replace(packed=src.view(out.packed.shape))
        else:
            for sl in deferred:
                out.packed[sl].view(src[sl].shape).copy_(src[sl])
    return out, int(sum(c.item() for c in shifted_counts)), any_general


def _carry_slab(
    src: Tensor, s: Tensor, tables: _CastTables, out: _CastOut, shifted_counts: list[Tensor],
    general_slabs: list[bool], deferred: list[slice] | None, sl: slice,
) -> None:
    """Rows ``sl`` of ``out``: block scales from the table (all-zero half-blocks: 1.0), codes carried or,
    for below-range blocks, shifted through the byte table; appends that slab's counts. Carried codes
    are copied now, or (``deferred`` given) their slab is appended to it for ``_carry_blocks``."""
    ss, blk = s[sl], src[sl]
    idx = _rule_index(ss, None if tables.row_offset is None else tables.row_offset[sl])
    rules = tables.rules
    b = out.bits[sl]
    torch.index_select(rules.bits2, 0, idx, out=b.view(torch.int16).view(-1))
    z = out.zero[sl]
    # The same values as ``eq(x, 0)`` / ``masked_fill_`` / ``any()``, in forms torch vectorizes for these
    # dtypes (measured ~3x, ~10x, ~4x faster on CPU): logical_not of the int64 words; b + z * (ONE - b),
    # which wraps to ONE in uint8 where z, else adds 0; amax of non-negative table entries.
    torch.logical_not(blk.view(torch.int64).view(z.shape) & _MAG_BITS, out=z)  # 16 codes all +-0
    b.add_(z.view(torch.uint8) * (_E4M3_ONE - b))  # all-zero half-blocks: block scale 1.0
    packed = out.packed[sl].view(blk.shape)
    shift = rules.shift.index_select(0, idx)
    if idx.numel() and bool(shift.amax() > 0):
        flags = rules.shifted2.index_select(0, idx).view(torch.uint8).view(z.shape)
        shifted_counts.append(torch.gt(flags, z.view(torch.uint8)).sum())  # shifted, not all zero
        bidx = torch.bitwise_or(shift.view(*ss.shape, 1), blk)
        torch.index_select(tables.shift_table, 0, bidx.view(-1), out=packed.view(-1))
    elif deferred is None:
        packed.copy_(blk)
    else:
        deferred.append(sl)
    general_slabs.append(bool(idx.numel()) and bool(rules.general.index_select(0, idx).amax() > 0))


def _requantize_general(out: _CastOut, s: Tensor, gs: Tensor, tables: _CastTables) -> int:
    """Requantize, in ``out``, every half-block the rules cannot carry or shift (and that is not all zero)
    from its exactly decoded values with ``nvfp4_quantize``'s numerics; return how many."""
    device = s.device
    general = tables.rules.general.index_select(0, _rule_index(s, tables.row_offset)).view(s.shape)
    need = _halves(general).bool() & ~out.zero
    idx = need.nonzero()
    r, h = idx[:, 0], idx[:, 1]
    half_bytes = out.packed.view(out.packed.shape[0], -1, NVFP4_BLOCK // 2)
    codes = unpack_fp4(half_bytes[r, h])  # [n, 16]
    vals = _table("code_value", device).index_select(0, codes.reshape(-1).int()).view(-1, NVFP4_BLOCK)
    vals *= _scale_table(device)[s[r, h // 2].int()].unsqueeze(-1)  # exact decode, as mxfp4_decode
    keys, bs, _ = _quantize_keys(vals.unsqueeze(1), gs[r] if gs.dim() else gs, unsigned_zero=True)
    new_codes = _table("key_code", device).index_select(0, keys.reshape(-1)).view(-1, NVFP4_BLOCK)
    new_bytes = pack_fp4(new_codes).unsqueeze(1)
    _saturate_nan_blocks(new_bytes, torch.isnan(bs.float()))
    half_bytes[r, h] = new_bytes.squeeze(1)
    out.bits[r, h] = bs.view(torch.uint8).view(-1)
    return int(idx.shape[0])
