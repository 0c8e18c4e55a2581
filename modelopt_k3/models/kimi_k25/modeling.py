"""Kimi-K2.5's text model class under the hub's names (``model.py`` says why): a subclass of transformers'
``Kimi_K25PreTrainedModel``, so imported only when a model is built (``common/lazy.py``)."""

from __future__ import annotations

from torch import nn
from transformers import DeepseekV3ForCausalLM
from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25PreTrainedModel


class KimiK25TextForCausalLM(Kimi_K25PreTrainedModel):
    """``language_model``: transformers' ``DeepseekV3ForCausalLM`` of ``config.text_config`` (module docstring)."""

    _no_split_modules = ["DeepseekV3DecoderLayer"]

    def __init__(self, config) -> None:
        super().__init__(config)
        self.language_model = DeepseekV3ForCausalLM(config.text_config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def forward(self, input_ids=None, **kwargs):
        return self.language_model(input_ids=input_ids, **kwargs)


__all__ = ["KimiK25TextForCausalLM"]
