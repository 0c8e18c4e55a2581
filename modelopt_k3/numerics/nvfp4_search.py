"""NVFP4 block-scale searches: pick each block's E4M3 scale by the error it leaves (pure tensor functions).

The export stays plain NVFP4 (FORMATS.md): only *which* E4M3 block scale a block gets changes, so
``nvfp4_quantize(w, global_scale, block_scale=...)`` writes it and every engine reads it unchanged.
Semantics follow nvidia-modelopt 0.47 (``calib/mse.py`` ``MseCalibrator``/``NVFP4MSECalibrator``,
``model_calib.py`` ``local_hessian_calibrate``), in pure torch so they run on CPU and CUDA:

- ``nvfp4_sweep_block_scales``: every positive finite E4M3 value (126 of them, ModelOpt's
  ``fp8_scale_candidates``) is tried as every block's scale under the given global scale; each block
  keeps the one with the least error, the first (smallest) on a tie among those that beat max's scale.
- ``nvfp4_multiplier_block_scales``: candidates are the max rule's block amax times each multiplier
  (ModelOpt's ``MseCalibrator`` on a static block quantizer); ties keep the earlier multiplier.
  Four-over-six is this with multipliers ``(1.0, 1.5)`` (block max mapped to 6, or to 4) under a
  global scale normalized to 256 instead of 448 (``nvfp4_global_scale_46``), so x1.5 stays in range.
- The error is the block's squared error, or with ``hessian [in/16, 16, 16]`` (each block's input
  second moment ``E[x xᵀ]``) the weighted ``dwᵀ H dw`` (local Hessian).

Decisions (ours; issue 42): a search never loses to max. A candidate replaces the max rule's scale only
where its error is strictly less, so every tie keeps max's scale: an all-zero block keeps 1.0; a block
whose objective at max's scale cannot rank candidates keeps max's scale: zero (a Linear whose calibration
inputs are all zero gives a zero Hessian; weights whose squared errors underflow fp32), fp32-subnormal (too
coarse to rank), NaN or infinite; ModelOpt's argmin takes the smallest candidate there (2**-9) and zeroes the
block. Errors are fp32, summed over the 16 elements of a block.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ._slabs import run_slabs
from .constants import FP4_MAX, NVFP4_BLOCK
from .e2m1 import _table
from .nvfp4 import _block_amax, _check_blocks, _quantize_keys, _rows_global_scale, _scales_from_amax

__all__ = [
    "FOUR_OVER_SIX_FP8_MAX",
    "FOUR_OVER_SIX_MULTIPLIERS",
    "e4m3_scale_candidates",
    "linspace_multipliers",
    "nvfp4_block_errors",
    "nvfp4_global_scale_46",
    "nvfp4_multiplier_block_scales",
    "nvfp4_sweep_block_scales",
]

_E4M3 = torch.float8_e4m3fn
_E4M3_ONE = 0x38  # the byte of 1.0 in float8_e4m3fn
FOUR_OVER_SIX_FP8_MAX = 256.0  # ModelOpt E4M3_MAX_46: the largest block scale before x1.5
FOUR_OVER_SIX_MULTIPLIERS = (1.0, 1.5)  # block max mapped to 6, then to 4


def e4m3_scale_candidates(device: torch.device | str = "cpu") -> Tensor:
    """The 126 positive finite float8_e4m3fn values, ascending (bytes 0x01..0x7E)."""
    return torch.arange(1, 127, dtype=torch.uint8, device=device).view(_E4M3)


def nvfp4_global_scale_46(amax: Tensor | float) -> Tensor:
    """Four-over-six's ``weight_scale_2``: ``amax / (6 * 256)`` in fp32; amax == 0 gives 1.0."""
    amax = torch.as_tensor(amax).float()
    return torch.where(amax == 0, 1.0, amax / amax.new_tensor(FP4_MAX * FOUR_OVER_SIX_FP8_MAX))


def nvfp4_block_errors(xb: Tensor, block_scale: Tensor, gs: Tensor, hessian: Tensor | None = None) -> Tensor:
    """fp32 error ``[R, nb]`` of blocks ``xb [R, nb, 16]`` quantized with e4m3 ``block_scale [R, nb]``
    under ``gs`` (0-d or ``[R, 1]``): ``sum dw²``, or ``dwᵀ H dw`` with ``hessian [nb, 16, 16]``."""
    x = xb.float()
    keys, _, eff = _quantize_keys(x, gs, block_scale)
    dw = x - _table("key_value", x.device)[keys] * eff
    if hessian is None:
        return (dw * dw).sum(dim=-1)
    return torch.einsum("rnb,nbd,rnd->rn", dw, hessian.float(), dw)


def _search(
    w: Tensor, global_scale: Tensor | float, n_candidates: int,
    candidate: Callable[[int, Tensor, Tensor], Tensor], hessian: Tensor | None,
) -> Tensor:
    """Per block, the candidate scale with strictly less error than the max rule's scale (the first such on
    ties among them), else the max rule's; ``candidate(i, amax, denom)`` gives candidate ``i``'s e4m3 scales
    ``[r, nb]`` for a slab's block amax ``[r, nb]``."""
    _check_blocks(w, "an NVFP4 block-scale search")
    w = w.detach()
    if w.dtype == torch.float64:
        w = w.float()
    *lead, n = w.shape
    nb = n // NVFP4_BLOCK
    if hessian is not None and tuple(hessian.shape) != (nb, NVFP4_BLOCK, NVFP4_BLOCK):
        raise ValueError(f"hessian must be [{nb}, {NVFP4_BLOCK}, {NVFP4_BLOCK}] for in={n}, got {tuple(hessian.shape)}")
    x = w.reshape(-1, nb, NVFP4_BLOCK)
    gs = _rows_global_scale(global_scale, w.shape, w.device)
    denom = gs * FP4_MAX
    out = torch.empty(x.shape[0], nb, dtype=_E4M3, device=w.device)
    h = None if hessian is None else hessian.to(w.device)

    def search(sl: slice) -> None:
        xs, g = x[sl], gs[sl] if gs.dim() else gs
        d = denom[sl] if denom.dim() else denom
        amax = _block_amax(xs)
        best = _scales_from_amax(amax, d)  # the max rule's scale: kept where nothing strictly beats it
        best_err = nvfp4_block_errors(xs, best, g, h)
        # An objective that cannot rank candidates keeps max's scale: NaN or inf (a NaN weight, an overflowing
        # Hessian), or below fp32's smallest normal (zero: all-zero inputs or block; subnormal: tiny weights).
        unrankable = ~torch.isfinite(best_err) | (best_err < torch.finfo(torch.float32).tiny)
        best_err = torch.where(unrankable, -math.inf, best_err)
        for i in range(n_candidates):
            bs = candidate(i, amax, d)
            err = nvfp4_block_errors(xs, bs, g, h)
            better = err < best_err
            best = torch.where(better, bs.view(torch.uint8), best.view(torch.uint8)).view(_E4M3)
            best_err = torch.where(better, err, best_err)
        out[sl] = best
        out[sl].view(torch.uint8).masked_fill_(amax == 0, _E4M3_ONE)

    run_slabs(x.shape[0], n * 8, w.device, search)  # n * 8: the loop's temporaries per row
    return out.view(*lead, nb)


def nvfp4_sweep_block_scales(w: Tensor, global_scale: Tensor | float, hessian: Tensor | None = None) -> Tensor:
    """Every block's E4M3 scale by sweeping all 126 positive finite E4M3 values (``fp8_scale_sweep``)."""
    cands = e4m3_scale_candidates(w.device)

    def candidate(i: int, amax: Tensor, denom: Tensor) -> Tensor:
        return cands[i].expand(amax.shape)

    return _search(w, global_scale, cands.numel(), candidate, hessian)


def nvfp4_multiplier_block_scales(
    w: Tensor, global_scale: Tensor | float, multipliers: Sequence[float], hessian: Tensor | None = None
) -> Tensor:
    """Every block's E4M3 scale from ``block_amax * m`` for the best ``m`` of ``multipliers``."""
    mults = [float(m) for m in multipliers]
    if not mults or min(mults) <= 0:
        raise ValueError(f"multipliers must be positive and at least one, got {mults}")

    def candidate(i: int, amax: Tensor, denom: Tensor) -> Tensor:
        return _scales_from_amax(amax * mults[i], denom)

    return _search(w, global_scale, len(mults), candidate, hessian)


def linspace_multipliers(start: float, stop: float, step: float) -> tuple[float, ...]:
    """ModelOpt's ``MseCalibrator`` candidates: ``linspace(start, stop, ceil((stop-start)/step)+1)``."""
    steps = math.ceil((stop - start) / step) + 1
    return tuple(torch.linspace(start, stop, steps=steps, dtype=torch.float32).tolist())
