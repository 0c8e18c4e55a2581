"""What a DeepSeek-V3 config.json must hold for the tools to read it (no model built).

transformers 5.24 ``DeepseekV3DecoderLayer``: layer ``i`` holds a ``DeepseekV3MoE`` (routed experts,
``n_shared_experts`` shared experts, the sigmoid group-limited router) iff ``i >= first_k_dense_replace``,
else a dense ``DeepseekV3MLP``; ``num_nextn_predict_layers`` MTP layers are stored as extra layers
``model.layers.{num_hidden_layers + j}`` that transformers does not build: ``carried_modules`` declares them
(``SourceCheckSpec.carried``), so every export carries them unquantized and the source check checks their tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...spec import CarriedModules
from ...spec.config import positive_int
from ..common.deepseek_text import check_config_fields as check_config_fields
from ..common.lazy import imported_attr, modeling_class
from ..common.mtp import mtp_carried
from ..common.mtp import mtp_layer_shapes as common_mtp_layer_shapes

# transformers' classes an MTP layer is read off (built on meta), imported only then (common/lazy.py).
DECODER_LAYER = modeling_class("deepseek_v3", "DeepseekV3DecoderLayer")
CONFIG_CLASS = imported_attr("transformers", "DeepseekV3Config")
# An MTP layer's own modules beside its decoder layer (DeepSeek-V3's hub checkpoint stores them BF16): name -> shape
# from (hidden_size, vocab_size).
MTP_EXTRAS = {
    "enorm.weight": lambda h, v: (h,),
    "hnorm.weight": lambda h, v: (h,),
    "eh_proj.weight": lambda h, v: (h, 2 * h),
    "embed_tokens.weight": lambda h, v: (v, h),
    "shared_head.norm.weight": lambda h, v: (h,),
    "shared_head.head.weight": lambda h, v: (v, h),
}


def mtp_layer_shapes(config: Mapping[str, Any], layer: int) -> dict[str, tuple[int, ...]]:
    """The logical tensors of MTP layer ``layer``: transformers' ``DeepseekV3DecoderLayer`` for that index, then
    ``MTP_EXTRAS`` (``models/common/mtp.py``)."""
    return common_mtp_layer_shapes(DECODER_LAYER, CONFIG_CLASS, config, layer, MTP_EXTRAS)


def carried_modules(config: Mapping[str, Any]) -> CarriedModules | None:
    """``SourceCheckSpec.carried``: the ``num_nextn_predict_layers`` MTP layers, ``model.layers.{num_hidden_layers
    + j}`` (transformers does not build them; vLLM and SGLang skip them in the main model, TensorRT-LLM never
    asks: models/deepseek_v3/serving.py). transformers' classes are imported only for a config with MTP layers."""
    return mtp_carried(DECODER_LAYER, CONFIG_CLASS, MTP_EXTRAS)(config)


def moe_layers(config: Mapping[str, Any]) -> list[int]:
    """Indices of the layers with routed experts (``DeepseekV3DecoderLayer.__init__``'s rule)."""
    return list(range(config.get("first_k_dense_replace", 0), positive_int(config, "num_hidden_layers")))
