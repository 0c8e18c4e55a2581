"""Fused routed experts for Kimi-K3, dispatched through transformers' experts interface.

The checkpoint stores every routed expert as its own ``KimiBlockSparseMLP`` (``w1`` gate, ``w3`` up,
``w2`` down). ``KimiK3Experts`` holds the same weights as two stacked tensors, the layout that
transformers' experts interface (``eager``, ``grouped_mm``, ``batched_mm``, and our ``torch_a2a``)
consumes:

* ``gate_up_proj [E, 2I, Dl]`` -- rows ``[:I]`` are ``w1`` (gate), rows ``[I:]`` are ``w3`` (up);
* ``down_proj [E, Dl, I]`` -- ``w2``.

Numerics follow the remote ``moe_infer`` (kimi_k3_reference.md section 4): SituAndMul per expert in
fp32 then cast back to the weight dtype before ``w2``; combine weights in fp32, summed in fp32 and
cast to the input dtype at the end.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.moe import use_experts_implementation

from ...dist.placement import ExpertPlacement
from ...experts.base import FusedExperts


@use_experts_implementation(is_concatenated=True, is_transposed=False, has_bias=False, has_gate=True)
class KimiK3Experts(FusedExperts):
    """The routed experts of one MoE layer that this rank holds (``placement``: all of them by default).

    Built with every expert (on meta, by the loader); ``place`` keeps the placement's block. Under
    expert parallelism the ``torch_a2a`` implementation maps global ids to their owner with the
    placement and calls the local implementation with local ids. Placement, the eager loop and the
    fp32 combine are the base's (``experts/base.py``); the activation is the checkpoint's own.
    """

    def __init__(
        self,
        config,
        *,
        num_experts: int,
        hidden_dim: int,
        intermediate_dim: int,
        act_fn: nn.Module,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts  # local experts (the experts interface reads it)
        self.placement = ExpertPlacement(num_experts)
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        # The checkpoint's own SituAndMul: it takes [gate || up] and computes in fp32.
        self.act_fn = act_fn
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_dim, hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, intermediate_dim))

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        # SituAndMul returns the input dtype, matching KimiBlockSparseMLP before its w2.
        return self.act_fn(gate_up)


def experts_implementations_available(device: torch.device | str = "cpu") -> list[str]:
    """Experts implementations that work for KimiK3Experts on ``device`` in this torch build."""
    names = ["eager", "batched_mm"]
    if hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm"):
        names.append("grouped_mm")
    return names
