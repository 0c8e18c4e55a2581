"""How each serving engine's Kimi-K3 class loads a checkpoint: the rules ``modelopt-k3-check`` replays.

Read from the engines' own Kimi-K3 code (the commit each rule was read at is cited with it):

* vLLM: vllm-project/vllm ``vllm/models/kimi_k3/nvidia/model.py`` @ 006193b5 (``KimiLinearModel``:
  ``load_weights`` stacked params, ``packed_modules_mapping``; ``KimiMoE``; ``KimiDecoderLayer``;
  ``KimiK3ForConditionalGeneration.hf_to_vllm_mapper``), ``nvidia/kda.py`` @ 055e47c2
  (``KimiK3DeltaAttention.in_proj_qkvgfab``), ``nvidia/mla.py`` @ 01b867e8
  (``MultiHeadLatentAttention``). The registry maps ``KimiK3ForConditionalGeneration`` to
  ``vllm.models.kimi_k3`` (its ``__init__`` picks ``nvidia/`` off ROCm).
* SGLang: sgl-project/sglang ``python/sglang/srt/models/kimi_k3.py`` @ 0000e9b4
  (``KimiK3ForConditionalGeneration.hf_to_sglang_mapper``/``load_weights``,
  ``KimiK3LinearForCausalLM.load_weights``/``post_load_weights``, ``KimiK3DeltaAttention``,
  ``KimiK3MoE``, ``KimiK3DecoderLayer``); MLA is ``DeepseekV2AttentionMLA`` (``deepseek_v2.py``).
* TensorRT-LLM: NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/models/modeling_kimi_linear.py`` @ cf328e85.

The engines' generic ModelOpt rules (config parsing, exclusions, scale use) are in
``modelopt_k3/check/engines``.
"""

from __future__ import annotations

import re

from ...check.engines import register_kv_scale_names, register_serving
from ...check.engines.base import Fused, ModelServing, WeightsMapper, kv_deviations
from ...check.layout import Layout, Linear
from ...check.report import EngineResult, Refusal
from ...formats import FP8, FP8_PB_WO, NVFP4
from .kv_cache import KV_SCALE_NAMES

EXPERT_RE = r"(?P<module>.+\.block_sparse_moe\.experts)\.(?P<expert>\d+)\.(?P<proj>w[123])"
GATE_UP = ("w1", "w3")  # fused into w13 by both engines' make_expert_params_mapping(w1, w2, w3)

VLLM_K3 = ModelServing(
    engine="vllm",
    model_type="kimi_k3",
    # model.py KimiK3ForConditionalGeneration.hf_to_vllm_mapper (no block_sparse_moe rename in vLLM:
    # KimiDecoderLayer registers the MoE as ``block_sparse_moe``).
    mapper=WeightsMapper(prefixes={
        "language_model.layers.": "language_model.model.layers.",
        "mm_projector.proj.0": "mm_projector.linear_1",
        "mm_projector.proj.2": "mm_projector.linear_2",
    }),
    strip_prefix="",
    fused=(
        # KimiLinearModel.load_weights stacked_params_mapping (use_full_rank_gate: g_proj is shard 3).
        Fused("in_proj_qkvgfab", ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")),
        Fused("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa")),
        Fused("gate_up_proj", ("gate_proj", "up_proj")),  # dense MLP and shared experts (KimiMLP)
    ),
    unquantized=(
        (r"\.routed_expert_(down|up)_proj$", "vLLM's K3 builds the latent-expert projections with "
                                            "quant_config=None (model.py KimiMoE)"),
        (r"_res_proj$", "vLLM's K3 builds the attention-residual projections with quant_config=None "
                        "and reads their weight as a vector (model.py attn_res)"),
        (r"\.block_sparse_moe\.gate$", "vLLM's K3 router is a GateLinear without quant_config (model.py KimiMoE)"),
    ),
    bf16_only=(
        (r"\.self_attn\.in_proj_qkvgfab$",
         "vLLM's K3 fuses KDA q/k/v/g/f_a/b into in_proj_qkvgfab and pads it to a multiple of 16 rows per "
         "TP rank with an extra shard whose weight_scale_2/input_scale are never loaded (torch.empty) yet "
         "enter the max() over shards (kda.py; K3 pads at TP 4 and 8, the tiny model at TP 1)"),
    ),
    # KimiLinearModel.packed_modules_mapping (its SupportsQuant mapping; g_proj and fused_qkv_a_proj are
    # absent, so the exclude list must match ``fused_qkv_a_proj`` itself to leave q_a/kv_a BF16).
    packed_modules_mapping={
        "gate_up_proj": ("gate_proj", "up_proj"),
        "in_proj_qkvgfab": ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj"),
    },
    expert_re=EXPERT_RE,
    gate_up=GATE_UP,
    # mla.py: the MLA layer is the attention layer itself (MultiHeadLatentAttention, an AttentionLayerBase
    # that is neither Attention nor MLAAttention), and ModelOpt's get_quant_method gives a KV-cache method
    # (which creates k_scale/v_scale) only to those two classes: no KV-scale parameter exists.
    kv_scale_params=(),
    kv_note="vLLM's K3 MLA layer is neither Attention nor MLAAttention, so the ModelOpt config creates no "
            "k_scale/v_scale for it (mla.py _init_kv_cache_quant, modelopt.py get_quant_method)",
)

SGLANG_K3 = ModelServing(
    engine="sglang",
    model_type="kimi_k3",
    # kimi_k3.py hf_to_sglang_mapper, then load_weights strips "language_model." before the LM sees names.
    mapper=WeightsMapper(prefixes={"language_model.layers.": "language_model.model.layers."},
                         substrs={"block_sparse_moe": "mlp"}),
    strip_prefix="language_model.",
    fused=(
        # KimiK3DeltaAttention with use_full_rank_gate and attn_tp == tp: fused_qkvg_proj [q, k, v, g].
        Fused("fused_qkvg_proj", ("q_proj", "k_proj", "v_proj", "g_proj")),
        # load_weights: q_a_proj / kv_a_proj_with_mqa rows of fused_qkv_a_proj_with_mqa (DeepseekV2AttentionMLA).
        Fused("fused_qkv_a_proj_with_mqa", ("q_a_proj", "kv_a_proj_with_mqa")),
        Fused("gate_up_proj", ("gate_proj", "up_proj")),  # KimiK3MLP (dense MLP and shared experts)
    ),
    unquantized=(
        (r"\.routed_expert_(down|up)_proj$", "SGLang's K3 builds the latent-expert projections with "
                                            "quant_config=None (kimi_k3.py KimiK3MoE)"),
        (r"_res_proj$", "SGLang's K3 builds the attention-residual projections with quant_config=None"),
        (r"\.gate$", "SGLang's K3 router MoEGate is built with quant_config=None"),
        (r"(^|\.)lm_head$", "SGLang's ModelOpt config quantizes only LinearBase layers; ParallelLMHead is not one "
                            "(modelopt.py _get_quant_method)"),
        (r"^(vision_tower|mm_projector)\.", "SGLang's K3 vision tower and projector are built without a quant config"),
    ),
    bf16_only=(
        (r"\.self_attn\.(f_a_proj|b_proj|f_b_proj)$",
         "SGLang's K3 KDA reads f_a/b/f_b_proj.weight directly as BF16 (_merge_bfa_weights, kimi_k3_tiny_gemm)"),
        (r"\.self_attn\.fused_qkv_a_proj_with_mqa$",
         "SGLang's K3 load_weights copies q_a_proj/kv_a_proj_with_mqa tensors into fused_qkv_a_proj_with_mqa by "
         "row-narrowing (param.data[:rows]); a per-tensor weight_scale_2/input_scale has no rows and one fused "
         "scalar cannot hold two"),
        (r"\.self_attn\.kv_b_proj$",
         "SGLang's K3 post_load_weights builds the absorbed w_kc/w_vc from kv_b_proj.weight as stored, with no "
         "dequantization"),
    ),
    packed_modules_mapping=None,  # ModelOptFp4Config.from_config: config.get("packed_modules_mapping")
    expert_re=EXPERT_RE,
    gate_up=GATE_UP,
    # DeepseekV2AttentionMLA's RadixAttention modules get ModelOpt's KV-cache method (k_scale/v_scale) when
    # the config names a kv_cache_quant_algo; the K3 loader skips names not in params_dict.
    kv_scale_params=("attn_mqa.k_scale", "attn_mqa.v_scale", "attn_mha.k_scale", "attn_mha.v_scale"),
    kv_note="SGLang's K3 MLA (DeepseekV2AttentionMLA) holds its scales on attn_mqa/attn_mha and the K3 "
            "load_weights skips names not in params_dict (kimi_k3.py)",
)


# ---------------------------------------------------------------------- TensorRT-LLM

TRT_EXPERT_RE = re.compile(
    r"^(?P<module>.+\.layers\.(?P<layer>\d+)\.block_sparse_moe\.experts)\.(?P<expert>\d+)\.(?P<proj>w[123])$")
TRT_KEY_PREFIXES = ("language_model.model.", "model.", "")
TRT_KEY_SUFFIXES = ("block_sparse_moe.experts", "mlp.experts")
# _K3_EXPERT_CKPT_SPECS: routed-expert quant algo -> the Linear.fmt its per-expert tensors must have.
TRT_EXPERT_FORMATS = {"W4A8_MXFP4_MXFP8": "mxfp4", NVFP4.algo: NVFP4.engine_method}
TRT_DEFAULT_EXPERTS = "W4A8_MXFP4_MXFP8"  # _K3_DEFAULT_ROUTED_QUANT_ALGO: the moonshotai/Kimi-K3 source
TRT_TRUNK_FORMATS = ("bf16", FP8.engine_method, FP8_PB_WO.engine_method)
TRT_KV_DROPPED = ("TensorRT-LLM's K3 loader keeps no KV-cache scale parameter; unmatched checkpoint keys only "
                  "warn (modeling_kimi_linear.py _validate_checkpoint_keys)")


def _trt_per_layer_algos(layout: Layout) -> dict[str, str]:
    """``quantized_layers`` (module -> quant_algo), from hf_quant_config.json or config.json."""
    for cfg in ((layout.hf_quant or {}).get("quantization"), layout.quant):
        if isinstance(cfg, dict) and isinstance(cfg.get("quantized_layers"), dict):
            return {k: str(v.get("quant_algo", "")).upper() for k, v in cfg["quantized_layers"].items()}
    return {}


def trt_routed_algo(per_layer: dict[str, str], layer: int) -> str:
    """``KimiK3MoERuntime._resolve_routed_quant_config``: the algo declared for the layer's experts
    module (keys ``<prefix>layers.{i}.<suffix>``), else the MXFP4 default."""
    for prefix in TRT_KEY_PREFIXES:
        for suffix in TRT_KEY_SUFFIXES:
            algo = per_layer.get(f"{prefix}layers.{layer}.{suffix}")
            if algo:
                return algo
    return TRT_DEFAULT_EXPERTS


def _trt_problem(linear: Linear, per_layer: dict[str, str]) -> str | None:
    m = TRT_EXPERT_RE.fullmatch(linear.name)
    if m is None:
        # load_param: one BF16 parameter per trunk Linear; _dequantize_fp8_block_scaled turns an FP8
        # weight + weight_scale (per-tensor, 2-D or 4-D block) into BF16; anything else misfits.
        if linear.fmt in TRT_TRUNK_FORMATS:
            return None
        return (f"stored {linear.fmt}; TensorRT-LLM's K3 keeps a BF16 [{', '.join(map(str, linear.shape))}] "
                "parameter here and reads only BF16 or FP8 (dequantized at load)")
    algo = trt_routed_algo(per_layer, int(m["layer"]))
    want = TRT_EXPERT_FORMATS.get(algo)
    if want is None:
        return f"routed experts declared {algo}; TensorRT-LLM's K3 reads only {sorted(TRT_EXPERT_FORMATS)}"
    if linear.fmt == want:
        return None
    why = "declared in quantized_layers" if algo != TRT_DEFAULT_EXPERTS else (
        "the default: quantized_layers declares no <prefix>layers.{i}.block_sparse_moe.experts entry")
    return f"stored {linear.fmt}, but TensorRT-LLM's K3 loads layer {m['layer']}'s routed experts as {algo} ({why})"


def replay_trtllm(layout: Layout, *, numerics: bool = True) -> EngineResult:
    """TensorRT-LLM's K3 ``load_weights``: name-by-name into BF16 trunk parameters and expert slots."""
    result = EngineResult("trtllm")
    per_layer = _trt_per_layer_algos(layout)
    for _, linear in sorted(layout.linears.items()):
        problem = _trt_problem(linear, per_layer)
        if problem:
            result.refusals.append(Refusal(linear.tensor_name(), problem))
    if layout.kv_scales:
        result.deviations += kv_deviations(layout, dict.fromkeys(layout.kv_scales, TRT_KV_DROPPED), numerics)
    return result


register_serving("kimi_k3", "vllm", VLLM_K3)
register_serving("kimi_k3", "sglang", SGLANG_K3)
register_serving("kimi_k3", "trtllm", replay_trtllm)


def kv_scale_names(config: dict) -> list[str]:
    """The KV-cache scales the exporter writes: one pair per MLA layer (every layer not in kda_layers)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    kda = set((text.get("linear_attn_config") or {}).get("kda_layers") or [])  # 1-indexed
    return [f"language_model.model.layers.{i}.self_attn.{key}"
            for i in range(int(text.get("num_hidden_layers", 0))) if i + 1 not in kda for key in KV_SCALE_NAMES]


register_kv_scale_names("kimi_k3", kv_scale_names)
