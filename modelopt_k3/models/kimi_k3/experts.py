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

from collections.abc import Callable

import torch
from torch import nn
from transformers.integrations.moe import use_experts_implementation


@use_experts_implementation(is_concatenated=True, is_transposed=False, has_bias=False, has_gate=True)
class KimiK3Experts(nn.Module):
    """``num_experts`` local experts starting at global expert id ``expert_offset``.

    In one process ``num_experts`` is the model's expert count and ``expert_offset`` is 0. Under
    expert parallelism each rank holds a contiguous block; the ``torch_a2a`` implementation maps global
    ids to the owner and calls the local implementation with local ids.
    """

    # Applied to the down projection's input (after the gate) by every implementation, via _apply_gate:
    # the declared point where a quantization layer quantizes that input (quant/modules.py).
    down_input_hook: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(
        self,
        config,
        *,
        num_experts: int,
        hidden_dim: int,
        intermediate_dim: int,
        act_fn: nn.Module,
        expert_offset: int = 0,
        num_global_experts: int | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.expert_offset = expert_offset
        self.num_global_experts = num_experts if num_global_experts is None else num_global_experts
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        # The checkpoint's own SituAndMul: it takes [gate || up] and computes in fp32.
        self.act_fn = act_fn
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_dim, hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, intermediate_dim))

    def __len__(self) -> int:
        return self.num_experts

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts} (global {self.expert_offset}..{self.expert_offset + self.num_experts - 1}"
            f" of {self.num_global_experts}), hidden={self.hidden_dim}, intermediate={self.intermediate_dim}"
        )

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        # SituAndMul returns the input dtype, matching KimiBlockSparseMLP before its w2.
        out = self.act_fn(gate_up_out)
        return out if self.down_input_hook is None else self.down_input_hook(out)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Eager implementation: one matmul pair per expert that received tokens.

        hidden_states [N, Dl], top_k_index [N, k] local expert ids, top_k_weights [N, k] fp32.
        """
        num_tokens, top_k = top_k_index.shape
        flat_ids = top_k_index.reshape(-1)
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        tokens = hidden_states[order // top_k]
        outputs = torch.empty(
            flat_ids.numel(), self.hidden_dim, dtype=self.down_proj.dtype, device=hidden_states.device
        )
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            x = tokens[rows].to(self.gate_up_proj.dtype)
            h = self._apply_gate(nn.functional.linear(x, self.gate_up_proj[expert]))
            outputs[rows] = nn.functional.linear(h, self.down_proj[expert])
            start += count
        per_slot = torch.empty_like(outputs)
        per_slot[order] = outputs
        combined = (per_slot.view(num_tokens, top_k, -1).float() * top_k_weights.float().unsqueeze(-1)).sum(1)
        return combined.to(hidden_states.dtype)


def experts_implementations_available(device: torch.device | str = "cpu") -> list[str]:
    """Experts implementations that work for KimiK3Experts on ``device`` in this torch build."""
    names = ["eager", "batched_mm"]
    if hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm"):
        names.append("grouped_mm")
    return names
