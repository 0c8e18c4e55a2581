"""``torch_a2a``: expert-parallel dispatch as a transformers experts implementation.

The experts module carries the run's ``ExpertPlacement`` (``module.placement``, set by the spec's
``place_experts``), which names the owner of every expert and the EP group. Each rank sends its (token,
slot) pairs to their owners (``dist.a2a``: ``dispatch_layout`` and ``exchange``), the owner runs its
local experts with the local implementation (weight 1.0, so the result is the bare expert output;
packed experts decode there, only there), the outputs come back and are combined at the origin exactly
as in one process: by the module's ``combine(per_slot, global ids, weights, dtype)`` (``FusedExperts``:
the combine its eager forward uses), else in fp32.

Works for any experts module that follows transformers' experts interface (``gate_up_proj`` /
``down_proj`` / ``_apply_gate``) and carries ``placement`` plus ``local_experts_implementation``
(the plan's choice, set by the loader). Every rank must call it the same number of times (the
calibration loop equalises batch counts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..dist.a2a import dispatch_layout, exchange, exchange_counts
from ..dist.placement import ExpertPlacement
from .base import combine_fp32
from .packed import DISPATCHES_ATTR, experts_functions, local_experts_forward

A2A_NAME = "torch_a2a"


def _local_forward(module: torch.nn.Module):
    # The plan's owner implementation (load.set_experts_implementation sets it on every experts module),
    # below the interface dispatch (which would route back to us); packed experts decode around it.
    return local_experts_forward(module, module.local_experts_implementation)


@torch.no_grad()
def torch_a2a_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    placement: ExpertPlacement = self.placement
    if not dist.is_initialized() or placement.ep_size == 1:
        local_ids = top_k_index - placement.local.start
        _observe_owner(self, hidden_states, local_ids)
        return _local_forward(self)(self, hidden_states, local_ids, top_k_weights)
    group = placement.group
    num_tokens, top_k = top_k_index.shape
    layout = dispatch_layout(top_k_index, placement)
    send_counts, recv_counts = exchange_counts(layout.send_counts, group)

    send_x = hidden_states[layout.token_rows]
    recv_x = exchange(send_x, send_counts, recv_counts, group)
    recv_ids = exchange(layout.owner_local_ids, send_counts, recv_counts, group)
    del send_x  # free each buffer once exchanged: the memory planner counts this sequence

    _observe_owner(self, recv_x, recv_ids.unsqueeze(1))
    ones = torch.ones(recv_ids.numel(), 1, dtype=torch.float32, device=recv_x.device)
    expert_out = _local_forward(self)(self, recv_x, recv_ids.unsqueeze(1), ones)
    del recv_x, recv_ids, ones

    back = exchange(expert_out, recv_counts, send_counts, group)
    del expert_out
    per_slot = layout.restore(back).view(num_tokens, top_k, -1)
    del back
    combine = getattr(self, "combine", None) or combine_fp32  # the module's own eager combine
    return combine(per_slot, top_k_index, top_k_weights, hidden_states.dtype)


def _observe_owner(module: torch.nn.Module, hidden: torch.Tensor, local_ids: torch.Tensor) -> None:
    hook = getattr(module, "owner_input_hook", None)
    if hook is not None:
        hook(module, hidden, local_ids)


@contextmanager
def owner_inputs(module: torch.nn.Module, hook: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], None],
                 ) -> Iterator[None]:
    """``hook(module, hidden [M, H], local ids [M, k])`` on the rank that runs ``module``'s local experts, with
    what they receive, for the block. Under ``torch_a2a`` the owner calls it after the exchange (the origin's
    forward pre-hooks, e.g. the input quantizer, already ran); under a local implementation (one process:
    every expert is local) a forward pre-hook registered after the module's others calls it."""
    module.owner_input_hook = hook
    handle = None
    if getattr(module.config, "_experts_implementation", None) != A2A_NAME:
        def pre_hook(mod, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
            hook(mod, hidden, ids - mod.placement.local.start)

        handle = module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield
    finally:
        module.owner_input_hook = None
        if handle is not None:
            handle.remove()


# Packed experts decode only on the owner, inside _local_forward, not before the exchange.
setattr(torch_a2a_experts_forward, DISPATCHES_ATTR, True)


def register_torch_a2a() -> None:
    """Register ``torch_a2a`` with transformers' experts interface (expert-parallel route only)."""
    registry = experts_functions()
    if A2A_NAME not in registry:
        registry.register(A2A_NAME, torch_a2a_experts_forward)
