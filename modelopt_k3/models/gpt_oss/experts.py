"""GPT-OSS routed experts in the layout the pipeline reads (``[E, out, in]``), through transformers' experts interface.

transformers' ``GptOssExperts`` holds its weights transposed (``[E, in, out]``, for ``x @ W``); the
quantization layer, the export and the packed decode block NVFP4 along the last dim, which must be the
input dim. ``GptOssFusedExperts`` holds the same numbers as the checkpoint stores them:

* ``gate_up_proj [E, 2I, H]``, rows interleaved as in the checkpoint (row 2j gate channel j, 2j+1 up);
  ``gate_up_proj_bias [E, 2I]`` in the same order;
* ``down_proj [E, H, I]``, ``down_proj_bias [E, H]``.

Its gate is transformers' clamped SwiGLU (``_apply_gate``), applied by every experts implementation
between the two projections; the combine over the k experts of a token is in fp32 (as ``torch_a2a``
does), so one process and expert parallelism give the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.integrations.moe import use_experts_implementation

from ...dist.placement import ExpertPlacement

FUSED_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


@use_experts_implementation(is_concatenated=False, is_transposed=False, has_bias=True, has_gate=True)
class GptOssFusedExperts(nn.Module):
    """The routed experts of one GPT-OSS MoE layer that this rank holds (``placement``: all by default)."""

    # The down projection's input transform (after the gate), applied by _apply_gate in every implementation:
    # where a quantization layer quantizes that input (quant/modules.py).
    down_input_hook: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts = config.num_local_experts  # local experts (the experts interface reads it)
        self.placement = ExpertPlacement(self.num_experts)
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.intermediate_size
        self.alpha = config.swiglu_alpha
        self.limit = config.swiglu_limit
        e, h, i = self.num_experts, self.hidden_dim, self.intermediate_dim
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))

    @property
    def num_global_experts(self) -> int:
        return self.placement.num_experts

    def place(self, placement: ExpertPlacement) -> None:
        """Keep only ``placement``'s experts (on a module holding them all, e.g. built on meta)."""
        if (self.placement.ep_size, placement.num_experts) != (1, self.num_experts):
            raise ValueError(f"place() needs a module holding all {placement.num_experts} experts; this one holds "
                             f"{self.num_experts} of {self.num_global_experts}")
        local = placement.local
        for name in FUSED_PARAMS:
            param = self._parameters[name]
            self._parameters[name] = nn.Parameter(param.data[local.start : local.stop].clone(), param.requires_grad)
        self.num_experts = len(local)
        self.placement = placement

    def __len__(self) -> int:
        return self.num_experts

    def extra_repr(self) -> str:
        first = self.placement.local.start
        return (f"experts={self.num_experts} (global {first}..{first + self.num_experts - 1} of "
                f"{self.num_global_experts}), hidden={self.hidden_dim}, intermediate={self.intermediate_dim}")

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        # transformers' GptOssExperts._apply_gate: interleaved halves, gate clamped above, up both sides.
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        out = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return out if self.down_input_hook is None else self.down_input_hook(out)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Eager implementation: one matmul pair per expert that received tokens.

        hidden_states [N, H], top_k_index [N, k] local expert ids, top_k_weights [N, k].
        """
        num_tokens, top_k = top_k_index.shape
        flat_ids = top_k_index.reshape(-1)
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        tokens = hidden_states[order // top_k]
        outputs = torch.empty(flat_ids.numel(), self.hidden_dim, dtype=self.down_proj.dtype, device=hidden_states.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            x = tokens[rows].to(self.gate_up_proj.dtype)
            h = self._apply_gate(nn.functional.linear(x, self.gate_up_proj[expert], self.gate_up_proj_bias[expert]))
            outputs[rows] = nn.functional.linear(h, self.down_proj[expert], self.down_proj_bias[expert])
            start += count
        per_slot = torch.empty_like(outputs)
        per_slot[order] = outputs
        combined = (per_slot.view(num_tokens, top_k, -1).float() * top_k_weights.float().unsqueeze(-1)).sum(1)
        return combined.to(hidden_states.dtype)
