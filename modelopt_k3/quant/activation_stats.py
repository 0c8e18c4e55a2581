"""Activation counters of the quantization report, held by input quantizers (``TensorQuantizer.stats``).

During calibration a counter sees every value its quantizer observes: how many, and how many lie
above a constant ``input_amax`` (with ``max`` calibration nothing lies above the calibrated amax: it
is the largest value seen, max-reduced over ranks). During the report's held-out pass
(``held_out_active``) it counts, under the final scale, values clipped and blocks whose scale
underflows (``numerics/stats.py``). Counts are per rank; the report sums them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..numerics.stats import input_counts
from .modules import iter_quantizers


class ActivationStats:
    """``calib`` [values, above constant amax]; ``held_out`` [values, clipped, blocks, blocks underflowing]."""

    def __init__(self) -> None:
        self.calib = torch.zeros(2, dtype=torch.int64)
        self.held_out = torch.zeros(4, dtype=torch.int64)
        self.held_out_active = False

    @torch.no_grad()
    def update(self, q, x: torch.Tensor) -> None:
        if q.mode == "calib":
            above = 0 if q.constant_amax is None else int((x.abs().float() > q.constant_amax).sum())
            self.calib += torch.tensor([x.numel(), above])
        elif q.mode == "quant" and self.held_out_active:
            block = q.fmt.group_size if q.fmt.per_tensor_scale else None
            self.held_out += input_counts(x, q.amax, q.scale(), block).cpu()


def attach_activation_stats(model: nn.Module) -> None:
    """A counter on every input quantizer (cheap: one comparison per value, and only for a constant amax)."""
    for _, q in iter_quantizers(model):
        if q.role == "input" and q.stats is None:
            q.stats = ActivationStats()


def held_out_counting(model: nn.Module, active: bool) -> None:
    for _, q in iter_quantizers(model):
        if q.stats is not None:
            q.stats.held_out_active = active
