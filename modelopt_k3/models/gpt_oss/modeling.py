"""GPT-OSS's model class: a subclass of transformers' ``GptOssForCausalLM`` (``model.py`` says what it does), so
imported only when a model is built (``common/lazy.py``)."""

from __future__ import annotations

from transformers import GptOssForCausalLM

from .experts import GptOssFusedExperts


class FusedGptOssForCausalLM(GptOssForCausalLM):
    """transformers' ``GptOssForCausalLM`` with ``GptOssFusedExperts`` in every built layer (see module docstring)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp.experts = GptOssFusedExperts(config)


__all__ = ["FusedGptOssForCausalLM"]
