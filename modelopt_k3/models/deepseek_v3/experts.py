"""DeepSeek-V3's fused routed experts: transformers' own ``DeepseekV3Experts`` instances, given our hook points.

transformers 5 stores a MoE layer's routed experts fused (``gate_up_proj [E, 2I, H]``: rows ``[:I]`` the
checkpoint's ``gate_proj``, ``[I:]`` its ``up_proj``; ``down_proj [E, H, I]``) behind its experts interface,
with the same eager numerics as Qwen3-MoE: per expert (ascending id) ``silu(gate) * up``, down, times the
(fp32) routing weight, rounded to the hidden dtype and ``index_add_``-ed in ascending expert order.
``place`` re-classes each built instance (never transformers' class) to ``DeepseekV3FusedExperts``, whose
eager forward sends the gate through ``_apply_gate`` (where ``down_input_hook`` applies) and whose
``combine`` is the one the eager forward and ``torch_a2a`` share. The loop and the combine are Qwen3-MoE's
(the same transformers eager code): reused, not re-derived.
"""

from __future__ import annotations

from torch import nn
from transformers.integrations.moe import use_experts_implementation
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

from ...dist.placement import ExpertPlacement
from ..qwen3_moe.experts import Qwen3MoeFusedExperts

FUSED_PARAMS = ("gate_up_proj", "down_proj")


@use_experts_implementation(is_concatenated=True, is_transposed=False, has_bias=False, has_gate=True)
class DeepseekV3FusedExperts(DeepseekV3Experts):
    """What a ``DeepseekV3Experts`` instance becomes on a model this project loads (``place``).

    ``placement``: the experts this rank holds (all of them in one process). Never constructed directly.
    """

    down_input_hook = None
    placement: ExpertPlacement

    _apply_gate = Qwen3MoeFusedExperts._apply_gate
    combine = Qwen3MoeFusedExperts.combine
    # The undecorated eager loop (the decorator above wraps it in the experts-interface dispatch once).
    forward = Qwen3MoeFusedExperts.forward.__wrapped__


def place(module: DeepseekV3Experts, placement: ExpertPlacement) -> None:
    """Re-class one built instance and keep only ``placement``'s experts (it must hold them all, e.g. on meta)."""
    if placement.num_experts != module.num_experts or getattr(module, "placement", None) is not None:
        raise ValueError(f"place() needs a module holding all {placement.num_experts} experts; this one holds "
                         f"{module.num_experts}")
    local = placement.local
    for name in FUSED_PARAMS:
        param = module._parameters[name]
        module._parameters[name] = nn.Parameter(param.data[local.start : local.stop].clone(), param.requires_grad)
    module.__class__ = DeepseekV3FusedExperts
    module.num_experts = len(local)
    module.placement = placement
