"""Kimi-K2.5's text model under the hub's names: transformers' ``DeepseekV3ForCausalLM`` as ``language_model``.

transformers' own ``Kimi_K25ForConditionalGeneration`` holds the text model as ``model.language_model`` and
``lm_head``, renaming the hub's ``language_model.model.*`` / ``language_model.lm_head`` as it loads. The
pipeline reads and writes each tensor under its module name, so the class here is a ``Kimi_K25PreTrainedModel``
whose one child, ``language_model``, is transformers' ``DeepseekV3ForCausalLM`` built from ``text_config``:
every text module's name is its hub name (an export needs no renaming back), its forward is transformers'
own (``tests/models/kimi_k25`` holds its logits to ``Kimi_K25ForConditionalGeneration``'s), and the vision tower
and projector are not built (``vision.py``: carried as stored). No checkpoint code runs. The class subclasses
transformers' modeling class, so it lives in ``modeling.py``, imported when a model is built (``common/lazy.py``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...spec import PrepareContext, SpecError
from ..common.compressed_sources import experts_converters, source_kind
from ..common.lazy import imported_attr, modeling_class
from ..common.probe import tiny_config
from ..common.spec import eager_experts

TEXT_PREFIX = "language_model."
MODEL_CLASS = imported_attr(f"{__package__}.modeling", "KimiK25TextForCausalLM")
TEXT_MODEL_CLASS = modeling_class("deepseek_v3", "DeepseekV3ForCausalLM")


def _text(config: Any) -> Any:
    return getattr(config, "text_config", config)


def prepare(ctx: PrepareContext) -> None:
    """The declared source (BF16 or INT4 pack-quantized routed experts: the released formats); eager experts at
    build (the loader installs the plan's implementation on the built experts)."""
    kind = source_kind(_text(ctx.config), "Kimi-K2.5")
    if kind == "block_fp8":
        raise SpecError("Kimi-K2.5 checkpoints are released BF16 or with INT4 pack-quantized experts; a block-FP8 "
                        "source is DeepSeek-V3's format (model_type deepseek_v3), not read under kimi_k25")
    if ctx.packed_experts:
        raise SpecError("the routed experts are stored packed in a format Kimi-K2.5 does not use")
    eager_experts(ctx)


def checkpoint_converters(ctx: PrepareContext) -> list:
    """The experts chain for the declared source (INT4 decoded as it loads, straight into this rank's rows)."""
    text = _text(ctx.config)
    return experts_converters(source_kind(text, "Kimi-K2.5"), text)


def probe_model(model_cls: type, config: Any, device: Any) -> tuple[nn.Module, str]:
    """``QuantSpec.probe_model``: a tiny ``DeepseekV3ForCausalLM`` of the text config (every layer kind kept); its
    names sit under ``language_model.`` in the checkpoint."""
    from ...spec.probe import random_probe_model

    text_model = TEXT_MODEL_CLASS()
    return random_probe_model(lambda: text_model(tiny_config(_text(config))), device), TEXT_PREFIX
