"""``torch_a2a``: expert-parallel dispatch as a transformers experts implementation.

Each rank holds a contiguous block of every MoE layer's experts; the experts module carries the run's
``ExpertPlacement`` (``module.placement``, set by the spec's ``place_experts``), which names the owner
of every expert and the EP group. Tokens travel to their owner with ``all_to_all_single`` (counts
first, then payload), the owner runs its local experts with the local implementation (weight 1.0, so
the result is the bare expert output), the outputs come back the same way and are combined at the origin
exactly as in one process: by the module's ``combine(per_slot, global ids, weights, dtype)`` when it has one
(the combine its eager forward uses), else in fp32. Which row goes where is ``dispatch_layout``, a pure function.

Works for any experts module that follows transformers' experts interface (``gate_up_proj`` /
``down_proj`` / ``_apply_gate``) and carries ``placement`` plus ``local_experts_implementation``
(the plan's choice, set by the loader). Every rank must call it the same number of times (the
calibration loop equalises batch counts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from ..packed_experts import DISPATCHES_ATTR, local_experts_forward
from .placement import ExpertPlacement

A2A_NAME = "torch_a2a"


@dataclass(frozen=True)
class DispatchLayout:
    """Where each (token, slot) pair of one rank's routing goes, in the order it is sent.

    Row ``j`` sent is flat pair ``order[j]`` (pair ``p`` = token ``p // top_k``, slot ``p % top_k``):
    hidden row ``token_rows[j]``, for expert ``owner_local_ids[j]`` of its owner. Pairs are grouped by
    owner rank (stable: in pair order within an owner); ``send_counts[r]`` rows go to rank ``r``.
    """

    order: torch.Tensor
    token_rows: torch.Tensor
    owner_local_ids: torch.Tensor
    send_counts: torch.Tensor

    def restore(self, back: torch.Tensor) -> torch.Tensor:
        """Rows returned in send order, put back in (token, slot) pair order."""
        per_slot = torch.empty_like(back)
        per_slot[self.order] = back
        return per_slot


def dispatch_layout(top_k_index: torch.Tensor, placement: ExpertPlacement) -> DispatchLayout:
    """The send order of ``top_k_index`` ([tokens, top_k] global expert ids) under ``placement``."""
    top_k = top_k_index.shape[1]
    flat_ids = top_k_index.reshape(-1)
    owner = placement.owner(flat_ids)
    order = owner.argsort(stable=True)
    return DispatchLayout(
        order=order,
        token_rows=order // top_k,
        owner_local_ids=flat_ids[order] - owner[order] * placement.per_rank,
        send_counts=torch.bincount(owner, minlength=placement.ep_size),
    )


def _local_forward(module: torch.nn.Module):
    # The plan's owner implementation (load.set_experts_implementation sets it on every experts module),
    # below the interface dispatch (which would route back to us); packed experts decode around it.
    return local_experts_forward(module, module.local_experts_implementation)


def _exchange(tensor: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    out = tensor.new_empty((sum(recv_counts), *tensor.shape[1:]))
    dist.all_to_all_single(
        out, tensor.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts, group=group
    )
    return out


@torch.no_grad()
def torch_a2a_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    placement: ExpertPlacement = self.placement
    if not dist.is_initialized() or placement.ep_size == 1:
        return _local_forward(self)(self, hidden_states, top_k_index - placement.local.start, top_k_weights)
    group = placement.group
    num_tokens, top_k = top_k_index.shape
    layout = dispatch_layout(top_k_index, placement)
    recv_counts_t = torch.empty_like(layout.send_counts)
    dist.all_to_all_single(recv_counts_t, layout.send_counts, group=group)
    send_counts, recv_counts = layout.send_counts.tolist(), recv_counts_t.tolist()

    send_x = hidden_states[layout.token_rows]
    recv_x = _exchange(send_x, send_counts, recv_counts, group)
    recv_ids = _exchange(layout.owner_local_ids, send_counts, recv_counts, group)
    del send_x  # free each buffer once exchanged: the memory planner counts this sequence

    ones = torch.ones(recv_ids.numel(), 1, dtype=torch.float32, device=recv_x.device)
    expert_out = _local_forward(self)(self, recv_x, recv_ids.unsqueeze(1), ones)
    del recv_x, recv_ids, ones

    back = _exchange(expert_out, recv_counts, send_counts, group)
    del expert_out
    per_slot = layout.restore(back).view(num_tokens, top_k, -1)
    del back
    combine = getattr(self, "combine", None)
    if combine is not None:  # the module's own eager combine (e.g. transformers' expert-order index_add)
        return combine(per_slot, top_k_index, top_k_weights, hidden_states.dtype)
    combined = (per_slot.float() * top_k_weights.float().unsqueeze(-1)).sum(1)
    return combined.to(hidden_states.dtype)


# Packed experts decode only on the owner, inside _local_forward, not before the exchange.
setattr(torch_a2a_experts_forward, DISPATCHES_ATTR, True)


def register_torch_a2a() -> None:
    """Register ``torch_a2a`` with transformers' experts interface (expert-parallel route only)."""
    if A2A_NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(A2A_NAME, torch_a2a_experts_forward)
