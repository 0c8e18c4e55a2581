"""``local_hessian``: max, then a forward with activations fake-quantized and weights not, recording each
dense NVFP4 Linear's per-block input second moment ``H_b = E[x_b x_bᵀ]`` (16x16 per block of in
features), then the block-scale search of ``mse`` weighted by it: error ``dwᵀ H_b dw``, which
approximates the block's share of ``||WX - ŴX||²`` (ModelOpt 0.47 ``local_hessian_calibrate``).

Across ranks (dense Linears are replicated, each rank saw its own tokens) the sums and token counts
are all-reduced in float64, so every rank picks the same scales; ModelOpt leaves this unsynced.
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
from ...formats import NVFP4_TENSOR
from ...numerics.constants import NVFP4_BLOCK
from ..modules import set_mode
from .base import ForwardLoop, register_calibrator
from .mse import MseCalibrator


class _Accumulator:
    """``sum x xᵀ`` in float64 and the number of tokens: per block ``[in/16, 16, 16]`` or full ``[in, in]``."""

    def __init__(self, blocks: bool) -> None:
        self.blocks = blocks
        self.sums: torch.Tensor | None = None
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        n_in = x.shape[-1]
        if self.blocks:
            xb = x.detach().reshape(-1, n_in // NVFP4_BLOCK, NVFP4_BLOCK).to(torch.float64)
            h = torch.einsum("tnb,tnd->nbd", xb, xb)
        else:
            xb = x.detach().reshape(-1, n_in).to(torch.float64)
            h = xb.T @ xb
        self.sums = h if self.sums is None else self.sums + h
        self.tokens += xb.shape[0]


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
    accs = {key: _Accumulator(blocks) for key in linears}
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


def _reduce(accs: dict[int, _Accumulator], linears: dict[int, nn.Module], blocks: bool,
            ) -> dict[int, tuple[torch.Tensor, int]]:
    """Sum every rank's moments and token counts: one flat float64 all-reduce, in module order."""
    g = current_group()
    shapes = {k: ((m.in_features // NVFP4_BLOCK, NVFP4_BLOCK, NVFP4_BLOCK) if blocks
                  else (m.in_features, m.in_features)) for k, m in linears.items()}
    flat = []
    for k, acc in accs.items():
        s = acc.sums
        flat.append((torch.zeros(shapes[k], dtype=torch.float64) if s is None else s.cpu()).reshape(-1))
        flat.append(torch.tensor([float(acc.tokens)], dtype=torch.float64))
    if not flat:
        return {}
    buf = torch.cat(flat)
    if g.world_size > 1:
        buf = buf.to(g.device)
        dist.all_reduce(buf, group=g.pg)
        buf = buf.cpu()
    out, pos = {}, 0
    for k in accs:
        size = math.prod(shapes[k])
        out[k] = (buf[pos:pos + size].reshape(shapes[k]), int(buf[pos + size]))
        pos += size + 1
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
