"""``local_hessian``: max, then a forward with activations fake-quantized and weights not, recording each
dense NVFP4 Linear's per-block input second moment ``H_b = E[x_b x_bᵀ]`` (16x16 per block of in
features), then the block-scale search of ``mse`` weighted by it: error ``dwᵀ H_b dw``, which
approximates the block's share of ``||WX - ŴX||²`` (ModelOpt 0.47 ``local_hessian_calibrate``).

Across ranks (dense Linears are replicated, each rank saw its own tokens) the sums and token counts
are all-reduced; the sums are integer-valued float64 (``_Accumulator``), so they are exact in any order
and N ranks pick the scales 1 process picks, bit for bit. ModelOpt leaves this unsynced.
Routed experts use the plain-error search: no per-expert input hook exists in the experts modules
yet (ModelOpt too falls back to plain MSE where it has none).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ...dist.collectives import run_together
from ...dist.group import current_group
from ...numerics.constants import NVFP4_BLOCK
from ..modules import set_mode
from ..schemes import NVFP4_TENSOR
from .base import ForwardLoop, register_calibrator
from .mse import MseCalibrator
from .weights import WeightSite

HI_BITS = 14  # x = hi * g1 + lo * g2 + r, |hi|, |lo| <= 2**14 (about), |r| <= 2**-29 * amax
MAX_EXACT_TOKENS = 1 << 21  # integer-valued float64 sums of hi*hi stay below 2**53 up to here


class _Accumulator:
    """``sum x xᵀ`` and the token count: per block ``[in/16, 16, 16]`` or full ``[in, in]``.

    Rank-independent: ``x`` is split on a power-of-two grid set by the Linear's calibrated input amax
    (the same on every rank) into integer-valued ``hi`` and ``lo``; sums of their products are exact
    in float64 whatever the order, so 1 process and N ranks get the same bits. ``x xᵀ`` is then
    ``hi hiᵀ g1² + (hi loᵀ + lo hiᵀ) g1 g2`` (the ``lo loᵀ`` term, below 2**-56 amax², is dropped).
    """

    def __init__(self, blocks: bool, amax: float) -> None:
        self.blocks = blocks
        e = math.ceil(math.log2(amax)) if amax > 0 and math.isfinite(amax) else 0
        self.g1, self.g2 = 2.0 ** (e - HI_BITS), 2.0 ** (e - 2 * HI_BITS)
        self.hh: torch.Tensor | None = None
        self.hl: torch.Tensor | None = None
        self.tokens = 0

    def _outer(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.blocks:
            return torch.einsum("tnb,tnd->nbd", a, b)
        return a.T @ b

    def add(self, x: torch.Tensor) -> None:
        n_in = x.shape[-1]
        shape = (-1, n_in // NVFP4_BLOCK, NVFP4_BLOCK) if self.blocks else (-1, n_in)
        x = x.detach().reshape(shape).to(torch.float64)
        hi = torch.round(x / self.g1)
        lo = torch.round((x - hi * self.g1) / self.g2)
        hh, hl = self._outer(hi, hi), self._outer(hi, lo)
        self.hh = hh if self.hh is None else self.hh + hh
        self.hl = hl if self.hl is None else self.hl + hl
        self.tokens += x.shape[0]

    def combine(self, hh: torch.Tensor, hl: torch.Tensor) -> torch.Tensor:
        """``sum x xᵀ`` from the (reduced) integer-valued sums."""
        cross = hl + hl.transpose(-1, -2)
        return hh * (self.g1 * self.g1) + cross * (self.g1 * self.g2)


def nvfp4_linears(model: nn.Module) -> dict[int, nn.Linear]:
    """The dense Linears with an NVFP4 weight quantizer, by ``id``, in module order."""
    return {id(m): m for m in model.modules()
            if type(m) is nn.Linear and getattr(m, "weight_quantizer", None) is not None
            and m.weight_quantizer.fmt is NVFP4_TENSOR}


def input_moments(model: nn.Module, forward_loop: ForwardLoop, *, blocks: bool, raw_input: bool,
                  ) -> dict[int, tuple[torch.Tensor, int]]:
    """One forward with activations fake-quantized and weights not: per dense NVFP4 Linear the sum of
    ``x xᵀ`` over every rank's tokens (float64, all-reduced) and the token count. ``raw_input``: the
    Linear's input as it arrives (before its own input quantizer), else as that quantizer leaves it."""
    linears = nvfp4_linears(model)
    accs = {key: _Accumulator(blocks, _input_amax(m)) for key, m in linears.items()}
    handles = [m.register_forward_pre_hook(lambda mod, args, a=accs[key]: a.add(args[0]), prepend=raw_input)
               for key, m in linears.items()]
    set_mode(model, "off", role="weight")
    try:
        run_together("second-moment forward", forward_loop, model)
    finally:
        for h in handles:
            h.remove()
        set_mode(model, "quant")
    return _reduce(accs, linears, blocks)


def _input_amax(linear: nn.Linear) -> float:
    """The Linear's calibrated input amax (identical on every rank), else its weight's amax (weight-only)."""
    q = linear.input_quantizer
    if q is not None and q.calibrated:
        return float(q.amax.max())
    return float(linear.weight_quantizer.amax.max())


def _reduce(accs: dict[int, _Accumulator], linears: dict[int, nn.Module], blocks: bool,
            ) -> dict[int, tuple[torch.Tensor, int]]:
    """Sum every rank's moments and token counts: one flat float64 all-reduce, in module order."""
    g = current_group()
    shapes = {k: ((m.in_features // NVFP4_BLOCK, NVFP4_BLOCK, NVFP4_BLOCK) if blocks
                  else (m.in_features, m.in_features)) for k, m in linears.items()}
    flat = []
    for k, acc in accs.items():
        for part in (acc.hh, acc.hl):
            flat.append((torch.zeros(shapes[k], dtype=torch.float64) if part is None else part.cpu()).reshape(-1))
        flat.append(torch.tensor([float(acc.tokens)], dtype=torch.float64))
    if not flat:
        return {}
    buf = torch.cat(flat)
    if g.world_size > 1:
        buf = buf.to(g.device)
        dist.all_reduce(buf, group=g.pg)  # integer-valued float64 sums: exact in any order
        buf = buf.cpu()
    out, pos = {}, 0
    for k, acc in accs.items():
        size = math.prod(shapes[k])
        hh, hl = buf[pos:pos + size].reshape(shapes[k]), buf[pos + size:pos + 2 * size].reshape(shapes[k])
        tokens = int(buf[pos + 2 * size])
        pos += 2 * size + 1
        if tokens > MAX_EXACT_TOKENS:
            raise ValueError(f"{tokens} calibration tokens reached one Linear; rank-independent Hessian sums are "
                             f"exact up to {MAX_EXACT_TOKENS}: calibrate on fewer tokens")
        out[k] = (acc.combine(hh, hl), tokens)
    return out


@register_calibrator
class LocalHessianCalibrator(MseCalibrator):
    method = "local_hessian"

    def __init__(self, algorithm) -> None:
        if algorithm.get("block_size") != NVFP4_BLOCK:
            raise ValueError(f"algorithm local_hessian: block_size must be the NVFP4 block {NVFP4_BLOCK}, "
                             f"got {algorithm.get('block_size')}")
        super().__init__(algorithm)
        self.hessians: dict[int, torch.Tensor] = {}

    def hessian(self, module: nn.Module, param: str) -> torch.Tensor | None:
        return self.hessians.get(id(module))

    def choice(self, site: WeightSite) -> tuple[str, str]:
        """Without a Hessian (routed experts; a Linear no token reached) the search is mse's plain-error one."""
        if self.hessian(site.module, site.param) is None:
            return "mse", f"{self.algorithm} (no input Hessian here: plain-error search)"
        return "local_hessian", str(self.algorithm)

    def calibrate(self, model: nn.Module, forward_loop: ForwardLoop | None,
                  groups: dict[str, tuple[str, ...]]) -> None:
        if forward_loop is None:
            raise ValueError("algorithm local_hessian needs calibration data (a forward_loop)")
        self.observe(model, forward_loop)
        self.reduce(model)
        super(MseCalibrator, self).finalize(model, groups)  # max's finalize: input scales, groups
        linears = nvfp4_linears(model)
        # The layer's input as it arrives, upstream activations fake-quantized (ModelOpt's hook sees it
        # before the layer's own input quantizer, which runs inside its forward).
        moments = input_moments(model, forward_loop, blocks=True, raw_input=True)
        self.hessians = {k: (sums / tokens).to(torch.float32).to(linears[k].weight.device)
                         for k, (sums, tokens) in moments.items() if tokens > 0}
        super().finalize_weights(model)
