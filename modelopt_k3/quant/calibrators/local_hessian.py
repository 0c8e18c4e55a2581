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
    """Per-block ``sum x xᵀ`` ``[in/16, 16, 16]`` in float64 and the number of tokens."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        n_in = x.shape[-1]
        xb = x.detach().reshape(-1, n_in // NVFP4_BLOCK, NVFP4_BLOCK).to(torch.float64)
        h = torch.einsum("tnb,tnd->nbd", xb, xb)
        self.sums = h if self.sums is None else self.sums + h
        self.tokens += xb.shape[0]


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
        self._collect_hessians(model, forward_loop)
        super().finalize_weights(model)

    def _collect_hessians(self, model: nn.Module, forward_loop: ForwardLoop) -> None:
        linears = {id(m): m for m in model.modules()
                   if type(m) is nn.Linear and getattr(m, "weight_quantizer", None) is not None
                   and m.weight_quantizer.fmt is NVFP4_TENSOR}
        accs = {key: _Accumulator() for key in linears}
        # After the input quantizer's pre-hook: H is of the (fake-quantized) input the weight sees.
        handles = [m.register_forward_pre_hook(lambda mod, args, a=accs[key]: a.add(args[0]))
                   for key, m in linears.items()]
        set_mode(model, "off", role="weight")
        try:
            run_together("local_hessian forward", forward_loop, model)
        finally:
            for h in handles:
                h.remove()
            set_mode(model, "quant")
        keys = sorted(accs, key=lambda k: _name_order(model)[k])
        self.hessians = _reduce(keys, accs, linears)


def _name_order(model: nn.Module) -> dict[int, int]:
    return {id(m): i for i, m in enumerate(model.modules())}


def _reduce(keys: list[int], accs: dict[int, _Accumulator], linears: dict[int, nn.Module]) -> dict[int, torch.Tensor]:
    """Sum every rank's Hessians and token counts (one flat float64 all-reduce); H / tokens in fp32."""
    g = current_group()
    flat = []
    for k in keys:
        m = linears[k]
        nb = m.in_features // NVFP4_BLOCK
        s = accs[k].sums
        flat.append((torch.zeros(nb, NVFP4_BLOCK, NVFP4_BLOCK, dtype=torch.float64) if s is None else s.cpu()).reshape(-1))
        flat.append(torch.tensor([float(accs[k].tokens)], dtype=torch.float64))
    if not flat:
        return {}
    buf = torch.cat(flat)
    if g.world_size > 1:
        buf = buf.to(g.device)
        dist.all_reduce(buf, group=g.pg)
        buf = buf.cpu()
    out, pos = {}, 0
    for k in keys:
        m = linears[k]
        size = (m.in_features // NVFP4_BLOCK) * NVFP4_BLOCK * NVFP4_BLOCK
        sums, tokens = buf[pos:pos + size], buf[pos + size]
        pos += size + 1
        if tokens > 0:
            h = (sums / tokens).reshape(-1, NVFP4_BLOCK, NVFP4_BLOCK).to(torch.float32)
            out[k] = h.to(m.weight.device)
    return out

