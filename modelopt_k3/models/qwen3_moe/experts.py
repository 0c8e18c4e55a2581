"""Qwen3-MoE's fused experts: transformers' own ``Qwen3MoeExperts`` instances, given the hook points we need.

transformers 5 already stores a layer's routed experts fused (``gate_up_proj [E, 2I, H]``, rows ``[:I]`` the
checkpoint's ``gate_proj``, ``[I:]`` its ``up_proj``; ``down_proj [E, H, I]``) behind its experts interface.
Two things are missing for us: its eager forward computes ``act(gate) * up`` inline, so nothing can
quantize the down projection's input, and it knows nothing of a placement. ``place_experts`` therefore
re-classes each built instance (never transformers' class) to ``Qwen3MoeFusedExperts``, a subclass
whose eager forward sends the gate through ``_apply_gate`` (where ``down_input_hook`` applies) and whose
``combine`` is the one the eager forward and ``torch_a2a`` both use.

Numerics are transformers' eager ones, bit for bit: per expert (ascending id) ``linear`` of the tokens
routed to it, ``silu(gate) * up``, ``linear`` down, times the routing weight, accumulated into a zero tensor
of the hidden dtype in ascending expert order (``index_add_``: one rounding per added expert).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.moe import use_experts_implementation
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from ...dist.placement import ExpertPlacement

FUSED_PARAMS = ("gate_up_proj", "down_proj")


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
class Qwen3MoeFusedExperts(Qwen3MoeExperts):
    """What a ``Qwen3MoeExperts`` instance becomes on a model this project loads (``place_experts``).

    ``placement``: the experts this rank holds (all of them in one process). Never constructed directly.
    """

    # The declared point where a quantization layer quantizes the down projection's input (quant/modules.py).
    down_input_hook = None
    placement: ExpertPlacement

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up_out.chunk(2, dim=-1)
        out = self.act_fn(gate) * up
        return out if self.down_input_hook is None else self.down_input_hook(out)

    def combine(self, per_slot: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """Bare outputs ``[N, k, H]`` of ``top_k_index``'s (global) experts -> the layer output (``torch_a2a``)."""
        return combine_in_expert_order(per_slot, top_k_index, top_k_weights, dtype)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """Eager: one matmul pair per expert that received tokens; ``top_k_index`` local ids ``[N, k]``."""
        num_tokens, top_k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = hidden_states[order // top_k]
        outputs = torch.empty(flat.numel(), self.hidden_dim, dtype=self.down_proj.dtype, device=hidden_states.device)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                h = self._apply_gate(nn.functional.linear(tokens[rows], self.gate_up_proj[expert]))
                outputs[rows] = nn.functional.linear(h, self.down_proj[expert])
                start += count
        per_slot = torch.empty_like(outputs)
        per_slot[order] = outputs
        return self.combine(per_slot.view(num_tokens, top_k, -1), top_k_index, top_k_weights, hidden_states.dtype)


def place(module: Qwen3MoeExperts, placement: ExpertPlacement) -> None:
    """Re-class one built instance and keep only ``placement``'s experts (it must hold them all, e.g. on meta)."""
    if placement.num_experts != module.num_experts or getattr(module, "placement", None) is not None:
        raise ValueError(f"place() needs a module holding all {placement.num_experts} experts; this one holds "
                         f"{module.num_experts}")
    local = placement.local
    for name in FUSED_PARAMS:
        param = module._parameters[name]
        module._parameters[name] = nn.Parameter(param.data[local.start : local.stop].clone(), param.requires_grad)
    module.__class__ = Qwen3MoeFusedExperts
    module.num_experts = len(local)
    module.placement = placement
