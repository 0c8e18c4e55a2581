"""Qwen3-MoE's fused experts: transformers' own ``Qwen3MoeExperts`` instances, given the hook points we need.

transformers 5 already stores a layer's routed experts fused (``gate_up_proj [E, 2I, H]``, rows ``[:I]`` the
checkpoint's ``gate_proj``, ``[I:]`` its ``up_proj``; ``down_proj [E, H, I]``) behind its experts interface.
Two things are missing for us: its eager forward computes ``act(gate) * up`` inline, so nothing can
quantize the down projection's input, and it knows nothing of a placement. ``place_experts`` therefore
re-classes each built instance (never transformers' class) to ``Qwen3MoeFusedExperts``, a subclass that
is also an experts base (``experts/base.py``): its eager forward sends the gate through ``_apply_gate``
(where ``down_input_hook`` applies), and it supplies its activation and its ``combine``, the one the eager
forward, ``torch_a2a`` and chunked packed decode all use.

Numerics are transformers' eager ones, bit for bit: per expert (ascending id) ``linear`` of the tokens
routed to it, ``silu(gate) * up``, ``linear`` down, times the routing weight, accumulated into a zero tensor
of the hidden dtype in ascending expert order (``index_add_``: one rounding per added expert).
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import use_experts_implementation
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from ...dist.placement import ExpertPlacement
from ...experts.base import FusedExperts


def combine_in_expert_order(
    per_slot: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """transformers' eager combine of bare expert outputs ``per_slot [N, k, H]``.

    Each output times its weight, rounded to ``dtype``, then added to a zero ``[N, H]`` accumulator one
    expert at a time in ascending global expert id (what ``index_add_`` over ``expert_hit`` does). The
    fp32 product of two BF16 values is exact, so rounding it once equals transformers' BF16 multiply.
    """
    weighted = (per_slot.float() * top_k_weights.float().unsqueeze(-1)).to(dtype)
    order = top_k_index.argsort(dim=1, stable=True)  # top-k ids of a token are distinct
    weighted = weighted.gather(1, order.unsqueeze(-1).expand_as(weighted))
    acc = torch.zeros(per_slot.shape[0], per_slot.shape[2], dtype=dtype, device=per_slot.device)
    for j in range(weighted.shape[1]):
        acc = acc + weighted[:, j]
    return acc


@use_experts_implementation(is_concatenated=True, is_transposed=False, has_bias=False, has_gate=True)
class Qwen3MoeFusedExperts(FusedExperts, Qwen3MoeExperts):
    """What a ``Qwen3MoeExperts`` instance becomes on a model this project loads (``place_experts``).

    ``placement``: the experts this rank holds (all of them in one process). Never constructed directly:
    ``place`` re-classes a built instance (``FusedExperts.adopt``). The base's eager loop runs the same
    per-expert matmuls as transformers' (its forward casts tokens to the weight dtype first: they are
    equal); the activation and the expert-order combine are transformers'.
    """

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def combine(self, per_slot: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """Bare outputs ``[N, k, H]`` of ``top_k_index``'s experts -> the layer output (transformers' order)."""
        return combine_in_expert_order(per_slot, top_k_index, top_k_weights, dtype)


def place(module: Qwen3MoeExperts, placement: ExpertPlacement) -> None:
    """Re-class one built instance and keep only ``placement``'s experts (it must hold them all, e.g. on meta)."""
    Qwen3MoeFusedExperts.adopt(module)
    module.place(placement)
