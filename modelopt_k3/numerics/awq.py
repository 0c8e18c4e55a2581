"""AWQ's per-input-channel smoothing scales (pure): the statistic, the scale rule and the alpha grid.

AWQ (Lin et al. 2023; ModelOpt's ``awq_lite``, llm-compressor's ``AWQModifier``) multiplies a Linear's weight
columns by ``s`` and divides its input channels by ``s``: the product is unchanged, but channels whose inputs
are large get their weights scaled up, so the weight quantizer spends its resolution where the output is most
sensitive. ``s = mean|x|^alpha`` normalised so that ``sqrt(max(s) * min(s)) = 1``, ``alpha`` chosen on a grid in
[0, 1] by the output error of the fake-quantized group (the calibrator's part; ``alpha = 0`` gives ``s = 1``
exactly: no smoothing). llm-compressor's ``duo_scaling`` divides by the weights' side too:
``s = mean|x|^alpha / (mean|w~|^(1 - alpha) + 1e-4)``, where ``|w~|`` is each weight's magnitude relative to the
largest of its quantization block (16 elements for NVFP4), averaged over every output row of the group
(``block_normalised_row_sums``): input channels whose weights are already large relative to their block get a
smaller ``s``.

``mean|x|`` must be the same bits whatever way the tokens are split over ranks or batches (the scales are folded
into exported weights, and EP 2 must export one process's bytes). Float sums are order-dependent, so each
``|x|`` is cut into integer-valued limbs on fixed power-of-two grids (``abs_sum_limbs``): sums of integers below
2**53 are exact in float64 in any order, and the limbs are combined once, after the reduction.
"""

from __future__ import annotations

import torch
from torch import Tensor

# |x| is split as sum_k l_k * 2**(TOP_EXP - LIMB_BITS * (k + 1)), 0 <= l_k < 2**LIMB_BITS: values up to 2**TOP_EXP,
# down to 2**(TOP_EXP - LIMB_BITS * LIMBS) (below that a value's remainder is dropped, the same on every rank).
TOP_EXP = 20
LIMB_BITS = 24
LIMBS = 4
MAX_EXACT_TOKENS = 1 << (53 - LIMB_BITS)  # integer-valued limb sums stay below 2**53 up to here
DUO_EPS = 1e-4  # added to the weight term of a duo scale (llm-compressor's)
NORM_EPS = 1e-6  # added to a block's amax before dividing by it (an all-zero block gives zeros, not NaN)
SCALE_FLOOR = 1e-4  # a channel never seen (mean 0) must not give s = 0 (llm-compressor's and ModelOpt's clamp)


def limb_grids(device: torch.device | None = None) -> Tensor:
    """``[LIMBS]`` float64 powers of two: the value of one unit of each limb."""
    exps = torch.tensor([TOP_EXP - LIMB_BITS * (k + 1) for k in range(LIMBS)], dtype=torch.float64, device=device)
    return torch.exp2(exps)


def abs_sum_limbs(x: Tensor) -> Tensor:
    """``[LIMBS, C]`` integer-valued float64 sums over every row of ``x [..., C]`` of ``|x|``'s limbs.

    Exact (integers below 2**53) for up to ``MAX_EXACT_TOKENS`` rows in all, in any order or split, so
    ``limbs_to_sum`` of a reduction over ranks is one process's value bit for bit. Refuses ``|x| >= 2**TOP_EXP``
    and non-finite values (no exact limb)."""
    a = x.detach().reshape(-1, x.shape[-1]).to(torch.float64).abs()
    if a.numel() and not bool((a < 2.0**TOP_EXP).all()):
        raise ValueError(f"awq: an activation is not finite or at least 2**{TOP_EXP} in magnitude "
                         f"(max {float(a.max()):.4g}): its mean cannot be summed exactly")
    out = []
    for g in limb_grids(a.device).tolist():
        limb = torch.floor(a / g)
        a = a - limb * g  # exact: limb * g is a's leading bits
        out.append(limb.sum(0))
    return torch.stack(out)


def limbs_to_sum(limbs: Tensor) -> Tensor:
    """``[C]`` float64 sums from ``abs_sum_limbs``' (reduced) limbs, combined in one fixed order."""
    grids = limb_grids(limbs.device)
    total = torch.zeros(limbs.shape[1:], dtype=torch.float64, device=limbs.device)
    for k in range(LIMBS):
        total = total + limbs[k] * grids[k]
    return total


def alpha_grid(step: float) -> list[float]:
    """``0, step, 2 step, ..., 1`` (1 included when ``step`` divides it; ModelOpt's ``alpha_step`` grid)."""
    n = int(round(1.0 / step))
    points = [round(i * step, 12) for i in range(n + 1) if i * step <= 1.0 + 1e-12]
    return points


def block_normalised_row_sums(weight: Tensor, block: int) -> Tensor:
    """``[..., out, in]`` -> float64 ``[..., in]``: every ``|w|`` divided by (its ``block``-wide input block's amax +
    ``NORM_EPS``), summed over the output rows (one row per leading index: a fused experts tensor gives one sum
    per expert). Divided by the group's total row count, the ``mean|w~|`` of ``awq_scales``' duo rule."""
    if weight.shape[-1] % block:
        raise ValueError(f"awq: input size {weight.shape[-1]} is not a multiple of the block {block}")
    w = weight.detach().to(torch.float64).abs()
    blocks = w.unflatten(-1, (-1, block))
    return (blocks / (blocks.amax(dim=-1, keepdim=True) + NORM_EPS)).flatten(-2).sum(dim=-2)


def awq_scales(mean_abs: Tensor, alpha: float, weight_mean: Tensor | None = None) -> Tensor:
    """``[C]`` float32 smoothing scales ``mean|x|^alpha`` (floored at ``SCALE_FLOOR``), or with ``weight_mean``
    (duo) ``mean|x|^alpha / (weight_mean^(1 - alpha) + DUO_EPS)`` floored at ``SCALE_FLOOR``, divided by
    ``sqrt(max * min)`` so they straddle 1. ``alpha = 0`` without ``weight_mean``: ones exactly."""
    if alpha == 0.0 and weight_mean is None:
        return torch.ones(mean_abs.shape, dtype=torch.float32, device=mean_abs.device)
    s = mean_abs.to(torch.float64).clamp(min=SCALE_FLOOR).pow(alpha)
    if weight_mean is not None:
        s = (s / (weight_mean.to(s.device, torch.float64).pow(1.0 - alpha) + DUO_EPS)).clamp(min=SCALE_FLOOR)
    s = s / torch.sqrt(s.max() * s.min())
    return s.to(torch.float32)


# ---------------------------------------------------------------------- folds into a Linear's output rows
# AWQ's other groups read no norm: o_proj reads attention(v), down_proj reads act(gate) * up. Their smoothing
# scales go into the producer's output rows (v's, up's) instead of a norm weight, which is exact only where each
# consumer input channel is one producer row times a function of other rows. ``probe_row_map`` finds that map from
# the model's own math; ``rows_of`` gives the map's per-row statistics (GQA: o channels repeat each v row).

PROBE_FACTOR = 2.0  # a power of two: scaling by it and back is exact, so a probe's "doubled" is bit-exact


def probe_row_map(probe, rows: int) -> Tensor | None:
    """``[consumer channels]`` int64: the producer row each consumer input channel scales with, or None.

    ``probe(c)`` returns the consumer's input ``[..., C]`` computed with the producer's ``rows`` output rows
    scaled by ``c [rows]`` (powers of two). A channel ``i`` maps to row ``m(i)`` when scaling that row by 2
    doubles channel ``i`` exactly and scaling rows other than the ones it depends on leaves it exactly as it was.
    Each bit ``b`` of the row index is read from two probes, the rows with bit ``b`` set doubled and the rows
    with it clear doubled: a channel that also depends non-linearly on another row (the gate of ``act(g) * u``)
    changes otherwise in exactly one of the two, and the other tells ``m(i)``'s bit. A last probe scales every
    mapped row by its own power of two and must scale every channel by its row's factor exactly. None: a
    channel depends on no single row linearly (``relu(u)**2``, ``(u + 1) * ...``, attention's softmax of q/k),
    or is zero on every probed token (undecidable)."""
    ref = probe(torch.ones(rows, dtype=torch.float64))
    if ref is None:
        return None
    ref = ref.reshape(-1, ref.shape[-1])
    if not bool((ref != 0).any(dim=0).all()):
        return None
    index = torch.arange(rows)
    bits = max(1, (rows - 1).bit_length())
    row_map = torch.zeros(ref.shape[-1], dtype=torch.int64)
    for b in range(bits):
        high = ((index >> b) & 1).bool()
        states = [_probe_states(probe, ref, mask) for mask in (high, ~high)]
        (d1, s1), (d0, s0) = states  # doubled / unchanged, with bit b set doubled; then with bit b clear
        one = (d1 & (s0 | ~(d0 | s0))) | (~(d1 | s1) & s0)  # bit b of m(i) set, read from the unaffected probe
        zero = (s1 & (d0 | ~(d0 | s0))) | (~(d1 | s1) & d0)
        if not bool((one ^ zero).all()):
            return None
        row_map |= one.to(torch.int64) << b
    if int(row_map.max()) >= rows:
        return None
    return row_map if _verify_row_map(probe, ref, row_map, rows) else None


def _probe_states(probe, ref: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per consumer channel: (exactly doubled, exactly unchanged) on every token, with ``mask``'s rows doubled."""
    c = torch.where(mask, PROBE_FACTOR, 1.0).to(torch.float64)
    y = probe(c)
    if y is None:
        return torch.zeros(ref.shape[-1], dtype=torch.bool), torch.zeros(ref.shape[-1], dtype=torch.bool)
    y = y.reshape(-1, y.shape[-1])
    return (y == ref * PROBE_FACTOR).all(dim=0), (y == ref).all(dim=0)


def _verify_row_map(probe, ref: Tensor, row_map: Tensor, rows: int) -> bool:
    """Every mapped row scaled by its own power of two (1/4 ... 4, by row index) scales each channel by its row's
    factor exactly; the rows no channel maps to stay at 1."""
    factors = torch.ones(rows, dtype=torch.float64)
    mapped = torch.unique(row_map)
    factors[mapped] = torch.exp2((mapped % 5 - 2).to(torch.float64))
    factors[mapped[factors[mapped] == 1.0]] = 0.5  # every mapped row moves
    y = probe(factors)
    if y is None:
        return False
    y = y.reshape(-1, y.shape[-1])
    return bool((y == ref * factors[row_map].to(ref.dtype)).all())


def rows_of(per_channel: Tensor, row_map: Tensor) -> tuple[Tensor, Tensor]:
    """``per_channel [..., C]`` float64 summed into the rows of ``row_map`` -> (``[..., R]`` sums over each mapped
    row's channels, in channel order, ``[R]`` int64 channel counts), ``R`` the mapped rows in ascending order
    (``torch.unique(row_map)``). Integer-valued limb sums stay exact (GQA's repeated o channels sum into one v row)."""
    mapped, inverse = torch.unique(row_map, return_inverse=True)
    out = torch.zeros((*per_channel.shape[:-1], len(mapped)), dtype=torch.float64, device=per_channel.device)
    out.index_add_(-1, inverse.to(per_channel.device), per_channel.to(torch.float64))
    return out, torch.bincount(inverse, minlength=len(mapped))
