"""Prepare transformers' own DeepSeek-V3 classes for our loader: the source format and its conversion.

Nothing of transformers is edited. ``prepare`` reads which source format the checkpoint declares
(``source_kind``); ``checkpoint_converters`` (the spec's conversion mapping) is the experts chain for it
(``source.experts_converters``: transformers' ``qwen2_moe`` stacking with the decode in front), so a rank
decodes only its own experts' bytes, straight into its rows. The experts' placement is the generic one
(``models/common/experts.py``).
"""

from __future__ import annotations

from typing import Any

from ...spec import PrepareContext, SpecError
from ..common.block_fp8 import FP8_QUANT_METHOD, quantization_config, weight_block_size
from ..common.spec import eager_experts
from .source import experts_converters, int4_group_size


def source_kind(config: Any) -> str:
    """``"bf16"`` (no quantization_config), ``"block_fp8"`` or ``"int4"`` (compressed-tensors
    pack-quantized experts); any other declared format is refused."""
    qcfg = quantization_config(config)
    if qcfg is None:
        return "bf16"
    method = qcfg.get("quant_method")
    if method == FP8_QUANT_METHOD:
        weight_block_size(config)
        return "block_fp8"
    if method == "compressed-tensors" and qcfg.get("format") == "pack-quantized":
        int4_group_size(config)
        return "int4"
    raise SpecError(f"the DeepSeek-V3 spec reads BF16, block-FP8 (quant_method 'fp8') and compressed-tensors "
                    f"pack-quantized INT4 checkpoints; this one declares quant_method {method!r}, format "
                    f"{qcfg.get('format')!r}")


def prepare(ctx: PrepareContext) -> None:
    kind = source_kind(ctx.config)
    if ctx.packed_experts and kind != "int4":
        raise SpecError(f"the routed experts are stored packed but config.json declares a {kind} source")
    eager_experts(ctx)


def checkpoint_converters(ctx: PrepareContext) -> list:
    """The spec's conversion mapping (``LoadingSpec.converters``): the experts chain for the declared source."""
    return experts_converters(source_kind(ctx.config), ctx.config)

