"""MiniMax-M2's model class under the hub's names: a subclass of transformers' ``MiniMaxM2ForCausalLM``, so imported
only when a model is built (``common/lazy.py``)."""

from __future__ import annotations

from transformers import MiniMaxM2ForCausalLM

from . import MOE


class MiniMaxM2HubForCausalLM(MiniMaxM2ForCausalLM):
    """transformers' ``MiniMaxM2ForCausalLM`` with each layer's MoE block registered as ``block_sparse_moe`` (the
    checkpoint's name). The instance attribute ``mlp`` still points at it, so transformers' forward is unchanged."""

    def __init__(self, config) -> None:
        super().__init__(config)
        for layer in self.model.layers:
            moe = layer.mlp
            layer._modules = {(MOE if k == "mlp" else k): m for k, m in layer._modules.items()}  # order kept
            object.__setattr__(layer, "mlp", moe)  # outside _modules: named once, as the hub names it


__all__ = ["MiniMaxM2HubForCausalLM"]
