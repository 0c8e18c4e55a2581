"""GPT-OSS routed experts in the layout the pipeline reads (``[E, out, in]``), through transformers' experts interface.

transformers' ``GptOssExperts`` holds its weights transposed (``[E, in, out]``, for ``x @ W``); the
quantization layer, the export and the packed decode block NVFP4 along the last dim, which must be the
input dim. ``GptOssFusedExperts`` holds the same numbers as the checkpoint stores them:

* ``gate_up_proj [E, 2I, H]``, rows interleaved as in the checkpoint (row 2j gate channel j, 2j+1 up);
  ``gate_up_proj_bias [E, 2I]`` in the same order;
* ``down_proj [E, H, I]``, ``down_proj_bias [E, H]``.

Everything but the math is the experts base's (``experts/base.py``: placement, the eager loop, the
``down_input_hook``). Its activation is transformers' clamped SwiGLU, applied by every experts
implementation between the two projections (``_apply_gate``); its biases are declared with
``has_bias=True``; the combine over the k experts of a token is the base's fp32 one (also ``torch_a2a``'s),
so one process and expert parallelism give the same bits.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.moe import use_experts_implementation

from ...dist.placement import ExpertPlacement
from ...experts.base import FusedExperts


@use_experts_implementation(is_concatenated=False, is_transposed=False, has_bias=True, has_gate=True)
class GptOssFusedExperts(FusedExperts):
    """The routed experts of one GPT-OSS MoE layer that this rank holds (``placement``: all by default).

    ``has_bias=True``: the base's eager loop and ``place`` carry ``gate_up_proj_bias``/``down_proj_bias``
    with their experts; the combine is the base's fp32 one.
    """

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

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        # The math of transformers' GptOssExperts gate: even columns are gate (clamped from above only),
        # odd ones up (clamped both sides); SwiGLU with a sigmoid gain alpha, and up offset by one.
        pairs = gate_up.unflatten(-1, (-1, 2))
        g = torch.clamp(pairs[..., 0], max=self.limit)
        u = torch.clamp(pairs[..., 1], -self.limit, self.limit)
        return (u + 1) * (g * torch.sigmoid(self.alpha * g))
