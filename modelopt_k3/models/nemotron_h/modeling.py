"""Nemotron-H's model and experts classes (``model.py`` says what they change): subclasses of transformers'
modeling classes, so imported only when a model is built (``common/lazy.py``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import NemotronHForCausalLM
from transformers.integrations.moe import use_experts_implementation
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

from ...experts.base import FusedExperts
from ..common.experts import combine_in_expert_order


@use_experts_implementation(is_concatenated=True, is_transposed=False, has_bias=False, has_gate=True)
class NemotronHFusedExperts(FusedExperts, NemotronHExperts):
    """transformers' ``NemotronHExperts`` with our placement and hooks; ``gate_up_proj`` is its ``up_proj``."""

    act_fn: Any

    def activation(self, up: torch.Tensor) -> torch.Tensor:
        """relu2 of the up projection's ``[.., I]`` output (non-gated: it is the down projection's input)."""
        return self.act_fn(up)

    def combine(self, per_slot: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """transformers' eager combine: weighted outputs added one expert at a time in ascending id."""
        return combine_in_expert_order(per_slot, top_k_index, top_k_weights, dtype)

    @classmethod
    def adopt(cls, module: nn.Module) -> None:
        """Re-class a built ``NemotronHExperts``: its ``up_proj`` renamed ``gate_up_proj`` in place (parameter
        order kept), gated dispatch on, and the experts' own width (the latent one) as ``hidden_dim``."""
        if isinstance(module, cls):
            return
        module._parameters = {("gate_up_proj" if k == "up_proj" else k): v for k, v in module._parameters.items()}
        module.has_gate = True
        module.hidden_dim = module._parameters["gate_up_proj"].shape[-1]
        super().adopt(module)


class NemotronHBackboneForCausalLM(NemotronHForCausalLM):
    """transformers' ``NemotronHForCausalLM`` holding its decoder as ``backbone`` (the hub's name) and its experts
    as ``NemotronHFusedExperts`` from construction, so every build of the class (the loader's, the export's
    completeness check, the probe) has the same parameter names."""

    base_model_prefix = "backbone"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._modules = {("backbone" if k == "model" else k): v for k, v in self._modules.items()}
        for module in self.modules():
            if isinstance(module, NemotronHExperts):
                NemotronHFusedExperts.adopt(module)

    @property
    def model(self) -> nn.Module:
        return self.backbone


__all__ = ["NemotronHBackboneForCausalLM", "NemotronHFusedExperts"]
