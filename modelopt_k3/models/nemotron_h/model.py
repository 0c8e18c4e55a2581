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

Both classes subclass transformers' modeling classes, so they live in ``modeling.py``, imported when a model is
built (``common/lazy.py``); this module holds what the spec reads without building one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import MergeModulelist, WeightConverter

from ...dist.placement import ExpertPlacement
from ...spec import PrepareContext, SpecError
from ...spec.probe import random_probe_model
from ..common.lazy import imported_attr, modeling_class
from ..common.probe import tiny_config

# The Mamba-2 widths the common probe table does not know (the mixer's inner width is heads x head_dim).
MAMBA_PROBE_WIDTHS = {"mamba_num_heads": 2, "mamba_head_dim": 8, "n_groups": 1, "ssm_state_size": 8,
                      "chunk_size": 8, "moe_latent_size": 16, "moe_shared_expert_intermediate_size": 16}

MODEL_CLASS = imported_attr(f"{__package__}.modeling", "NemotronHBackboneForCausalLM")
EXPERTS_CLASS = imported_attr(f"{__package__}.modeling", "NemotronHFusedExperts")
TRANSFORMERS_EXPERTS = modeling_class("nemotron_h", "NemotronHExperts")


def place_experts(model: nn.Module, placement: ExpertPlacement) -> None:
    """``ExpertsSpec.place_experts``: every experts module narrowed to the placement."""
    base, fused = TRANSFORMERS_EXPERTS(), EXPERTS_CLASS()
    for module in model.modules():
        if isinstance(module, base):
            fused.adopt(module)
            module.place(placement)


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
