"""The expert-parallel token exchange: which (token, slot) pair goes to which rank, and the all-to-all.

Each rank holds a contiguous block of every MoE layer's experts (``ExpertPlacement``). A token's pairs
travel to their experts' owners with ``all_to_all_single`` (counts first, then payload) and their
outputs come back the same way. Which row goes where is ``dispatch_layout``, a pure function; ``exchange``
is the collective. The experts implementation that uses them (``torch_a2a``) is
``modelopt_k3/experts/dispatch.py``: this layer knows placements and process groups, not experts modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .placement import ExpertPlacement


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


def exchange_counts(send_counts: torch.Tensor, group) -> tuple[list[int], list[int]]:
    """(rows this rank sends to each rank, rows it receives from each), from every rank's ``send_counts``."""
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    return send_counts.tolist(), recv_counts.tolist()


def exchange(tensor: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """``all_to_all_single`` of ``tensor``'s rows: ``send_counts[r]`` rows to rank ``r``, ``recv_counts`` back."""
    out = tensor.new_empty((sum(recv_counts), *tensor.shape[1:]))
    dist.all_to_all_single(
        out, tensor.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts, group=group
    )
    return out
