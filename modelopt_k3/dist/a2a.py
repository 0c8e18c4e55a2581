"""``torch_a2a``: expert-parallel dispatch as a transformers experts implementation.

Each rank holds a contiguous block of every MoE layer's experts (``module.expert_offset``,
``module.num_experts`` local of ``module.num_global_experts``). For each (token, slot) pair the owner
rank is ``expert_id // experts_per_rank``. Tokens travel to their owner with ``all_to_all_single``
(counts first, then payload), the owner runs its local experts with the local implementation
(weight 1.0, so the result is the bare expert output), the outputs come back the same way and are
combined in fp32 at the origin exactly as in one process.

Works for any experts module that follows transformers' experts interface (``gate_up_proj`` /
``down_proj`` / ``_apply_gate``) and carries the three placement attributes above, plus
``local_experts_implementation`` (the plan's choice, set by the loader). Every rank must call it the
same number of times (the calibration loop equalises batch counts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from ..models.packed_experts import DISPATCHES_ATTR, local_experts_forward

A2A_NAME = "torch_a2a"
# The process group tokens are exchanged in: None = the world (EP degree = world size); with a smaller
# EP degree, this rank's group of ``ep_degree`` contiguous ranks (set once by ``init_expert_groups``).
_EP_GROUP = None


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
    group=None,
) -> torch.Tensor:
    per_rank = self.num_experts
    ep_size = self.num_global_experts // per_rank
    group = _EP_GROUP if group is None else group
    if not dist.is_initialized() or ep_size == 1:
        return _local_forward(self)(self, hidden_states, top_k_index - self.expert_offset, top_k_weights)
    num_tokens, top_k = top_k_index.shape
    flat_ids = top_k_index.reshape(-1)
    owner = torch.div(flat_ids, per_rank, rounding_mode="floor")
    order = owner.argsort(stable=True)
    send_counts_t = torch.bincount(owner, minlength=ep_size)
    recv_counts_t = torch.empty_like(send_counts_t)
    dist.all_to_all_single(recv_counts_t, send_counts_t, group=group)
    send_counts, recv_counts = send_counts_t.tolist(), recv_counts_t.tolist()

    send_x = hidden_states[order // top_k]
    send_ids = flat_ids[order] - owner[order] * per_rank  # owner-local ids
    recv_x = _exchange(send_x, send_counts, recv_counts, group)
    recv_ids = _exchange(send_ids, send_counts, recv_counts, group)
    del send_x, send_ids  # free each buffer once exchanged: the memory planner counts this sequence

    ones = torch.ones(recv_ids.numel(), 1, dtype=torch.float32, device=recv_x.device)
    expert_out = _local_forward(self)(self, recv_x, recv_ids.unsqueeze(1), ones)
    del recv_x, recv_ids, ones

    back = _exchange(expert_out, recv_counts, send_counts, group)
    del expert_out
    per_slot = torch.empty_like(back)
    per_slot[order] = back
    del back
    combined = (per_slot.view(num_tokens, top_k, -1).float() * top_k_weights.float().unsqueeze(-1)).sum(1)
    return combined.to(hidden_states.dtype)


def init_expert_groups(world_size: int, ep_degree: int, rank: int) -> None:
    """Create the expert-parallel groups (every rank must call this, in the same order)."""
    global _EP_GROUP
    if ep_degree == world_size:
        _EP_GROUP = None
        return
    for start in range(0, world_size, ep_degree):
        group = dist.new_group(list(range(start, start + ep_degree)))
        if start <= rank < start + ep_degree:
            _EP_GROUP = group


# Packed experts decode only on the owner, inside _local_forward, not before the exchange.
setattr(torch_a2a_experts_forward, DISPATCHES_ATTR, True)


def register_torch_a2a() -> None:
    """Register ``torch_a2a`` with transformers' experts interface (expert-parallel route only)."""
    if A2A_NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(A2A_NAME, torch_a2a_experts_forward)
