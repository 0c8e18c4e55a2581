"""Nemotron-H's model class as this project builds it: transformers' own ``NemotronH*`` classes under the hub's
names, with the routed experts on our experts base.

Two things differ from transformers' model, and nothing it computes:

* Names. The hub checkpoint stores the decoder under ``backbone.`` (``backbone.layers.N.mixer.*``), which
  transformers' loader renames to ``model.``. This project's loader, exporter and source check read every dense
  tensor under the model's own name, so ``NemotronHBackboneForCausalLM`` holds transformers' ``NemotronHModel``
  as ``backbone`` (``model`` stays readable: transformers' forward calls ``self.model``), and checkpoint and
  module names are the same. No renaming anywhere in the pipeline, so the export keeps the hub's names.
* Experts. transformers' ``NemotronHExperts`` is non-gated (``up_proj [E, I, L]``, relu2, ``down_proj
  [E, L, I]``, ``L`` the latent width between ``fc1_latent_proj`` and ``fc2_latent_proj``) and declares
  ``has_gate=False``, so its grouped_mm path applies the activation inline, where no hook can quantize the down
  projection's input. ``NemotronHFusedExperts`` holds the up projection as the experts base's first projection
  (``gate_up_proj``, here ``[E, I, L]``: nothing to split) and declares ``has_gate=True``, so every implementation
  calls ``_apply_gate``: relu2, then ``down_input_hook``. Its eager numerics are transformers' bit for bit (per
  expert in ascending id: up, relu2, down, times the routing weight, added in expert order).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, NemotronHForCausalLM
from transformers.core_model_loading import MergeModulelist, WeightConverter
from transformers.integrations.moe import use_experts_implementation
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

from ...dist.placement import ExpertPlacement
from ...experts.base import FusedExperts
from ...spec import PrepareContext, SpecError
from ...spec.probe import random_probe_model
from ..common.experts import combine_in_expert_order
from ..common.probe import tiny_config

# The Mamba-2 widths the common probe table does not know (the mixer's inner width is heads x head_dim).
MAMBA_PROBE_WIDTHS = {"mamba_num_heads": 2, "mamba_head_dim": 8, "n_groups": 1, "ssm_state_size": 8,
                      "chunk_size": 8, "moe_latent_size": 16, "moe_shared_expert_intermediate_size": 16}


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


def place_experts(model: nn.Module, placement: ExpertPlacement) -> None:
    """``ExpertsSpec.place_experts``: every experts module narrowed to the placement."""
    for module in model.modules():
        if isinstance(module, NemotronHExperts):
            NemotronHFusedExperts.adopt(module)
            module.place(placement)


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


class NemotronHClass:
    """The spec's model class source: transformers' Nemotron-H classes under the hub's names (no checkpoint code)."""

    remote_code = False

    def resolve(self, path: Path, raw: Mapping[str, Any], trust_remote_code: bool) -> tuple[type, Any]:
        return NemotronHBackboneForCausalLM, AutoConfig.from_pretrained(path, trust_remote_code=False)


def checkpoint_converters(ctx: PrepareContext) -> list:
    """The hub's per-expert ``mixer.experts.{e}.{up,down}_proj.weight`` stacked into the fused parameters (the
    experts part of transformers' ``nemotron_h`` mapping, onto our ``gate_up_proj``; its ``backbone.`` rename is not
    needed: the model holds ``backbone``)."""
    return [
        WeightConverter(source_patterns=["mixer.experts.*.up_proj.weight"], target_patterns="mixer.experts.gate_up_proj",
                        operations=[MergeModulelist(dim=0)]),
        WeightConverter(source_patterns=["mixer.experts.*.down_proj.weight"], target_patterns="mixer.experts.down_proj",
                        operations=[MergeModulelist(dim=0)]),
    ]


def prepare(ctx: PrepareContext) -> None:
    if getattr(ctx.config, "quantization_config", None) is not None:
        raise SpecError("this Nemotron-H checkpoint is already quantized (config.json has a quantization_config); "
                        "the Nemotron-H spec reads BF16 checkpoints only")
    ctx.config._experts_implementation = "eager"


def probe_model(model_cls: type, config: Any, device: torch.device) -> tuple[nn.Module, str]:
    """``QuantSpec.probe_model``: the common tiny config with the Mamba-2 and latent widths made tiny too."""
    def build() -> nn.Module:
        tiny = tiny_config(config)
        for key, value in MAMBA_PROBE_WIDTHS.items():
            if getattr(tiny, key, None) is not None:  # no latent width (Nemotron-3 Nano): experts at hidden size
                setattr(tiny, key, value)
        return model_cls(tiny)

    return random_probe_model(build, device), ""
