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
MTP_REASON = "MTP layer (not built by transformers; carried unquantized)"


def mtp_layer_shapes(config: Mapping[str, Any], layer: int) -> dict[str, tuple[int, ...]]:
    """The logical tensors of MTP layer ``layer`` (``model.layers.{layer}``) and their shapes, in module order:
    transformers' ``DeepseekV3DecoderLayer`` for that index, built on meta (routed experts per expert Linear, as
    checkpoints store them), then ``MTP_EXTRAS``."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "quantization_config")}
    cfg = DeepseekV3Config(**{**fields, "num_hidden_layers": layer + 1})
    with torch.device("meta"):
        decoder = DeepseekV3DecoderLayer(cfg, layer)
    prefix = f"model.layers.{layer}"
    out: dict[str, tuple[int, ...]] = {}
    tensors = [*decoder.named_parameters(),
               *((f"{m}.{n}" if m else n, b) for m, mod in decoder.named_modules()
                 for n, b in mod.named_buffers(recurse=False) if n not in mod._non_persistent_buffers_set)]
    for name, t in tensors:
        head, _, param = name.rpartition(".")
        if head.endswith("mlp.experts") and param in ("gate_up_proj", "down_proj"):
            num, rows, cols = t.shape
            projs = ("gate_proj", "up_proj") if param == "gate_up_proj" else ("down_proj",)
            out.update((f"{prefix}.{head}.{e}.{proj}.weight", (rows // len(projs), cols))
                       for e in range(num) for proj in projs)
        else:
            out[f"{prefix}.{name}"] = tuple(t.shape)
    h, v = positive_int(config, "hidden_size"), positive_int(config, "vocab_size")
    out.update((f"{prefix}.{name}", shape(h, v)) for name, shape in MTP_EXTRAS.items())
    return out


def carried_modules(config: Mapping[str, Any]) -> CarriedModules | None:
    """``SourceCheckSpec.carried``: the ``num_nextn_predict_layers`` MTP layers, ``model.layers.{num_hidden_layers
    + j}`` (transformers does not build them; vLLM and SGLang skip them in the main model, TensorRT-LLM never
    asks: models/deepseek_v3/serving.py)."""
    first, n = positive_int(config, "num_hidden_layers"), config.get("num_nextn_predict_layers") or 0
    if not n:
        return None
    tensors: dict[str, tuple[int, ...]] = {}
    for layer in range(first, first + n):
        tensors.update(mtp_layer_shapes(config, layer))
    return CarriedModules(tuple(f"model.layers.{i}" for i in range(first, first + n)), tensors, MTP_REASON)


def moe_layers(config: Mapping[str, Any]) -> list[int]:
    """Indices of the layers with routed experts (``DeepseekV3DecoderLayer.__init__``'s rule)."""
    return list(range(config.get("first_k_dense_replace", 0), positive_int(config, "num_hidden_layers")))
