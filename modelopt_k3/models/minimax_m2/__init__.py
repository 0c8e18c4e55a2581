"""MiniMax-M2 / M2.5 (``model_type: minimax_m2``, transformers' own ``MiniMaxM2*`` classes): the spec.

Built by ``models/common``'s ``transformers_moe_spec``. What is MiniMax-M2's own:

* Names. The hub checkpoint keeps Mixtral's names (``block_sparse_moe``; experts ``w1`` gate, ``w3`` up, ``w2``
  down) and every engine loads those; transformers renames ``block_sparse_moe`` to ``mlp`` as it loads. Our
  model registers each layer's MoE block under the hub's name (``MiniMaxM2HubForCausalLM``), so load, decisions,
  export and serving rules all speak the checkpoint's names and nothing is renamed back on the way out.
* Source: the release is block-FP8 (``quant_method: fp8``, 128x128, attention and expert Linears; router, its
  bias, embeddings, norms and ``lm_head`` plain), decoded as it loads by the shared ``common/block_fp8.py``;
  a BF16 copy (no ``quantization_config``) reads too.
* Recipes, serving rules, the memory model.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers.core_model_loading import WeightConverter

from ...spec import PrepareContext, RecipesSpec, ServingSpec, SpecError, register_spec
from ..common.block_fp8 import (
    FP8,
    FP8_QUANT_METHOD,
    FP8_SCALE,
    BlockFp8Decode,
    fused_experts_converters,
    quantization_config,
    weight_block_size,
)
from ..common.lazy import imported_attr, lazy_attrs
from ..common.spec import eager_experts, transformers_moe_spec
from .memory import activation_memory

MOE = "block_sparse_moe"
EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down (Mixtral's)
# Our subclass of transformers' model class (``modeling.py``), imported when a model is built (``common/lazy.py``).
HUB_MODEL_CLASS = imported_attr(f"{__name__}.modeling", "MiniMaxM2HubForCausalLM")
# The block-FP8 source's dense Linears: attention only (every layer is MoE; the router is stored plain).
_DENSE_FP8 = r"(self_attn\.(?:q|k|v|o)_proj)"


def source_kind(config: Any) -> str:
    """``"bf16"`` (no quantization_config) or ``"block_fp8"``; any other declared format is refused."""
    qcfg = quantization_config(config)
    if qcfg is None:
        return "bf16"
    if qcfg.get("quant_method") == FP8_QUANT_METHOD:
        weight_block_size(config)
        return "block_fp8"
    raise SpecError(f"the MiniMax-M2 spec reads BF16 and block-FP8 (quant_method 'fp8') checkpoints; this one "
                    f"declares quant_method {qcfg.get('quant_method')!r}")


def prepare(ctx: PrepareContext) -> None:
    source_kind(ctx.config)
    eager_experts(ctx)


def checkpoint_converters(ctx: PrepareContext) -> list:
    """Per-expert ``w1``/``w3``/``w2`` -> ``gate_up_proj``/``down_proj``, decoded first from a block-FP8 source."""
    fp8 = source_kind(ctx.config) == "block_fp8"
    head = [BlockFp8Decode(weight_block_size(ctx.config))] if fp8 else []
    return fused_experts_converters(f"{MOE}.experts", EXPERT_NAMES[:2], EXPERT_NAMES[2],
                                    (FP8, FP8_SCALE) if fp8 else (FP8,), head)


DENSE_FP8_CONVERTERS = (
    WeightConverter(source_patterns=[_DENSE_FP8 + r"\.weight$", _DENSE_FP8 + r"\.weight_scale_inv$"],
                    target_patterns=r"\1.weight", operations=[BlockFp8Decode()]),
)


def serving_rules() -> Mapping[str, Any]:
    """``ServingSpec.rules``: built from ``check/``'s classes, so imported when a check first asks."""
    from .serving import SERVING

    return SERVING


def make_stand_in(path: str | Path, **sizes: Any) -> Path:
    """``ModelSpec.stand_in``: the tiny block-FP8 MiniMax-M2 (``testing/minimax_m2.py``)."""
    from ...testing.minimax_m2 import make_tiny_minimax_m2

    return make_tiny_minimax_m2(path, **sizes)


MINIMAX_M2_SPEC = register_spec(
    transformers_moe_spec(
        "minimax_m2", HUB_MODEL_CLASS,
        num_experts_attr="num_local_experts",
        experts_module=f"{MOE}.experts",
        expert_names=EXPERT_NAMES,
        prepare=prepare,
        converters=checkpoint_converters,
        loading={"source_formats": frozenset(), "dense_converters": DENSE_FP8_CONVERTERS},
        activation_memory=activation_memory,
        layout_fields=("num_hidden_layers", "num_local_experts", "intermediate_size", "hidden_size"),
        recipes=RecipesSpec(
            qformat={"nvfp4": "models/MiniMaxAI/MiniMax-M2/nvfp4"},
            converter=None,
            no_converter_reason="NVFP4 input scales of its FP8 experts need calibration",
        ),
        serving=ServingSpec(rules=serving_rules),
        stand_in=make_stand_in,
    ),
)

__getattr__ = lazy_attrs(__name__, {"MiniMaxM2HubForCausalLM": HUB_MODEL_CLASS})

__all__ = ["MINIMAX_M2_SPEC", "MiniMaxM2HubForCausalLM"]
