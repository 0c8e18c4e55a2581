"""GLM-5 / GLM-5.1 (``model_type: glm_moe_dsa``, transformers' own ``GlmMoeDsa*`` classes): the spec.

Built by ``models/common``'s ``transformers_moe_spec`` (fused ``GlmMoeDsaExperts``, transformers' ``qwen2_moe``
conversion of the per-expert ``gate_proj``/``up_proj``/``down_proj``), the shared MLA KV-cache site and the shared
MTP carry (``common/mtp.py``: the ``num_nextn_predict_layers`` layers ``model.layers.{num_hidden_layers + j}``,
which transformers does not build, carried unquantized as DeepSeek-V3's are). The DSA indexer
(``self_attn.indexer``) runs on CPU in transformers' eager/SDPA path (plain matmuls and ``topk``: no kernel to
refuse); its top-k selection is discontinuous in its inputs, so every recipe keeps it BF16. What is GLM-5's own:
BF16 sources only (the FP8 release is refused with the reason), the MTP extras it stores, recipes, memory model.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from ...spec import PrepareContext, RecipesSpec, ServingSpec, SpecError, register_spec
from ...spec.kv_cache import KvCacheSite
from ..common.kv_cache import mla_kv_cache_sites, mla_kv_scale_names
from ..common.lazy import imported_attr, modeling_class
from ..common.mtp import mtp_carried
from ..common.spec import eager_experts, transformers_moe_spec
from .memory import activation_memory

# GLM-5's MTP layer beside its decoder layer: DeepSeek-V3's extras less a layer-local embedding and head (it shares
# the model's; the release stores neither): name -> shape from (hidden_size, vocab_size).
MTP_EXTRAS = {
    "enorm.weight": lambda h, v: (h,),
    "hnorm.weight": lambda h, v: (h,),
    "eh_proj.weight": lambda h, v: (h, 2 * h),
    "shared_head.norm.weight": lambda h, v: (h,),
}
# transformers' classes, imported when a model (or an MTP layer, on meta) is built, not with the spec.
ATTENTION = modeling_class("glm_moe_dsa", "GlmMoeDsaAttention")
DECODER_LAYER = modeling_class("glm_moe_dsa", "GlmMoeDsaDecoderLayer")
CONFIG_CLASS = imported_attr("transformers", "GlmMoeDsaConfig")  # transformers' lazy module imports its auto maps
LAYOUT_FIELDS = ("num_hidden_layers", "first_k_dense_replace", "n_routed_experts", "moe_intermediate_size",
                 "hidden_size")


def prepare(ctx: PrepareContext) -> None:
    if getattr(ctx.config, "quantization_config", None) is not None:
        raise SpecError("this GLM-5 checkpoint is already quantized (config.json has a quantization_config, e.g. the "
                        "FP8 release); the GLM-5 spec reads the BF16 release (zai-org/GLM-5) only")
    eager_experts(ctx)


def kv_cache_sites(model: nn.Module) -> list[KvCacheSite]:
    attention = ATTENTION()
    return mla_kv_cache_sites(model, lambda module: isinstance(module, attention))


def kv_scale_names(config: dict) -> list[str]:
    return mla_kv_scale_names("model.layers", list(range(int(config.get("num_hidden_layers", 0)))))


def serving_rules() -> Mapping[str, Any]:
    """``ServingSpec.rules``: built from ``check/``'s classes, so imported when a check first asks."""
    from .serving import serving

    return serving()


def make_stand_in(path: str | Path, **sizes: Any) -> Path:
    """``ModelSpec.stand_in``: the tiny GLM-5 with its MTP layer (``testing/glm_moe_dsa.py``)."""
    from ...testing.glm_moe_dsa import make_tiny_glm_moe_dsa

    return make_tiny_glm_moe_dsa(path, **sizes)


GLM_MOE_DSA_SPEC = register_spec(
    transformers_moe_spec(
        "glm_moe_dsa", "GlmMoeDsaForCausalLM",
        num_experts_attr="n_routed_experts",
        prepare=prepare,
        quant={"kv_cache_sites": kv_cache_sites},
        activation_memory=activation_memory,
        layout_fields=LAYOUT_FIELDS,
        carried=mtp_carried(DECODER_LAYER, CONFIG_CLASS, MTP_EXTRAS),
        recipes=RecipesSpec(
            qformat={"nvfp4": "models/zai-org/GLM-5/nvfp4"},
            converter=None,
            no_converter_reason="its routed experts are BF16, so NVFP4 input scales need calibration",
        ),
        serving=ServingSpec(rules=serving_rules, kv_scale_names=kv_scale_names),
        stand_in=make_stand_in,
    ),
)

__all__ = ["GLM_MOE_DSA_SPEC"]
