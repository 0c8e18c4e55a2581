"""DeepSeek-V3's fused routed experts: transformers' own ``DeepseekV3Experts`` instances on the experts base.

transformers 5 stores a MoE layer's routed experts fused (``gate_up_proj [E, 2I, H]``: rows ``[:I]`` the
checkpoint's ``gate_proj``, ``[I:]`` its ``up_proj``; ``down_proj [E, H, I]``) behind its experts interface,
with the same eager numerics as Qwen3-MoE: per expert (ascending id) ``silu(gate) * up``, down, times the
(fp32) routing weight, rounded to the hidden dtype and ``index_add_``-ed in ascending expert order.
``place`` re-classes each built instance (never transformers' class) to ``DeepseekV3FusedExperts``, an
experts base (``experts/base.py``: placement, the eager loop, ``down_input_hook``) that supplies only its
activation and that expert-order combine (Qwen3-MoE's, the same transformers eager code: reused).
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import use_experts_implementation
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

from ...dist.placement import ExpertPlacement
from ...experts.base import FusedExperts
from ..qwen3_moe.experts import combine_in_expert_order


@use_experts_implementation(is_concatenated=True, is_transposed=False, has_bias=False, has_gate=True)
class DeepseekV3FusedExperts(FusedExperts, DeepseekV3Experts):
    """What a ``DeepseekV3Experts`` instance becomes on a model this project loads (``place``).

    ``placement``: the experts this rank holds (all of them in one process). Never constructed directly.
    """

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def combine(self, per_slot: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """Bare outputs ``[N, k, H]`` of ``top_k_index``'s experts -> the layer output (transformers' order)."""
        return combine_in_expert_order(per_slot, top_k_index, top_k_weights, dtype)


def place(module: DeepseekV3Experts, placement: ExpertPlacement) -> None:
    """Re-class one built instance and keep only ``placement``'s experts (it must hold them all, e.g. on meta)."""
    DeepseekV3FusedExperts.adopt(module)
    module.place(placement)
