"""How each serving engine's Qwen3-MoE class loads a checkpoint: the rules ``modelopt-k3-check`` replays.

* vLLM 0.33.0 (the PyPI wheel): ``vllm/model_executor/models/qwen3_moe.py``. ``Qwen3MoeAttention.__init__``
  fuses ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj`` (``QKVParallelLinear``); ``Qwen3MoeMLP`` (the
  ``mlp_only_layers`` / off-``decoder_sparse_step`` layers) fuses ``gate_proj``/``up_proj`` into
  ``gate_up_proj``; ``Qwen3MoeModel.hf_to_vllm_mapper`` keeps the checkpoint's names otherwise;
  ``Qwen3MoeForCausalLM.packed_modules_mapping`` has ``qkv_proj``, plus ``gate_up_proj`` only when
  ``mlp_only_layers`` is set (``__init__``); ``Qwen3MoeSparseMoeBlock.__init__`` builds the router
  ``GateLinear`` *with* the quant config (a ``ReplicatedLinear``: unquantized only when excluded) and the
  experts as one ``FusedMoE`` loading the checkpoint's per-expert ``gate_proj``/``up_proj`` as ``w13`` and
  ``down_proj`` as ``w2``.
* SGLang 0.5.23 (the PyPI wheel): ``sglang/srt/models/qwen3_moe.py``. ``Qwen3MoeAttention.__init__``
  ``qkv_proj``; ``Qwen3MoeSparseMoeBlock.__init__`` builds the router ``gate`` as a ``ReplicatedLinear``
  with ``quant_config=None`` unless the config is ``modelslim``; ``Qwen3MoeForCausalLM.packed_modules_mapping``
  ``{qkv_proj, gate_up_proj}``; ``load_weights``: ``stacked_params_mapping`` (qkv, gate_up) and
  ``FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
  ckpt_up_proj_name="up_proj")``; names not in ``params_dict`` are skipped.
  ``Qwen3MoeDecoderLayer.stage_facts`` hard-codes ``sparse=True`` ("Qwen3MoE all layers are sparse"), so
  ``mlp_only_layers`` / ``decoder_sparse_step`` are ignored: a dense layer's ``mlp.{gate,up,down}_proj`` land
  in no parameter (skipped, no error) and that layer's experts and router are never written -- the engine
  serves different numbers. ``arg_groups/model_overrides/qwen3_moe.py`` ``_qwen3_moe_family_overrides`` (on
  SM100, the NVFP4 MoE hardware) turns the default ``--moe-runner-backend auto`` into ``flashinfer_trtllm``
  for ``modelopt_fp4``/``fp8``/``modelopt_mixed`` configs, and into ``marlin`` only for a ``modelopt_mixed``
  config whose ``quantized_layers`` give ``.experts`` layers W4A16_NVFP4; flashinfer_trtllm's post-processing
  then asserts the expert GEMM rows % 128 and serves W4A16 experts with activation scale 1.0
  (``check/engines/sglang.py``).
* TensorRT-LLM (PyTorch backend; NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/models/modeling_qwen3_moe.py`` @
  03441af1, ``checkpoints/hf/qwen3_moe_weight_mapper.py`` @ 16f10114 and ``qwen2_moe_weight_mapper.py`` @
  00be09f7; generic ModelOpt rules in ``modelopt_k3/check/engines/trtllm.py``): ``Qwen3MoEDecoderLayer``
  builds *every* layer's ``mlp`` as ``Qwen3MoE`` (no dense MLP for ``mlp_only_layers``: such a checkpoint is
  refused -- the tiny stand-in has one, the released Qwen3-MoE checkpoints have none); its router
  ``Qwen3Gate`` is a bare BF16 ``weight`` parameter copied as stored (no quant method, whatever the
  exclusions say); ``Qwen3Attention`` fuses q/k/v into ``qkv_proj``; the experts load in
  ``MoEWeightLoadingMode.VANILLA`` (``Qwen2MoeHfWeightMapper.handle_special_instance_module`` renames the
  per-expert ``gate_proj``/``up_proj``/``down_proj`` to ``w1``/``w3``/``w2``), so per-expert NVFP4 experts with
  their own ``weight_scale_2`` load, provided w1/w3 of an expert share ``weight_scale_2`` and ``input_scale``
  (asserted). Checkpoint names are the engine's (the HF mapper renames nothing else).

KV-cache scales: the Qwen3-MoE spec declares no KV-cache sites (no ``--kv_cache_qformat`` for it yet), so an
export holds none; the parameters below are where both engines' ``Attention``/``RadixAttention`` would take them.
"""

from __future__ import annotations

import re

from ...check.engines.base import Fused, ModelServing, WeightsMapper
from ...check.engines.trtllm import (
    NVFP4_SCALES,
    equal_scales,
    format_refusal,
    replay_vanilla_experts_model,
    trt_excluded,
    trt_method,
    trt_why,
)
from ...check.layout import Layout, Linear
from ...check.report import EngineResult, Refusal
from ...quant.schemes import NVFP4, W4A16_NVFP4

EXPERT_RE = r"(?P<module>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>(?:gate|up|down)_proj)"
GATE_UP = ("gate_proj", "up_proj")  # w13 in both engines' make_expert_params_mapping
QKV = Fused("qkv_proj", ("q_proj", "k_proj", "v_proj"))
DENSE_GATE_UP = Fused("gate_up_proj", GATE_UP)

VLLM_QWEN3_MOE = ModelServing(
    engine="vllm",
    model_type="qwen3_moe",
    mapper=WeightsMapper(),
    strip_prefix="",
    fused=(QKV, DENSE_GATE_UP),
    unquantized=(),
    formats_only=(),
    # The class's packed_modules_mapping; gate_up_proj is added by __init__ only for a config with
    # mlp_only_layers, but it only matters where a dense Qwen3MoeMLP exists, which needs exactly that
    # (or a decoder_sparse_step > 1, where vLLM's per-shard lookup then uses the pieces' own names).
    packed_modules_mapping={"qkv_proj": QKV.pieces, "gate_up_proj": GATE_UP},
    expert_re=EXPERT_RE,
    gate_up=GATE_UP,
    kv_scale_params=("attn.k_scale", "attn.v_scale"),
    kv_note="vLLM's Qwen3MoeAttention holds its KV-cache scales on its Attention layer (attn)",
)



def sglang_moe_runner(layout: Layout) -> str:
    """``_qwen3_moe_family_overrides`` under ``auto`` on SM100: marlin only for a modelopt_mixed config with
    W4A16_NVFP4 ``.experts`` layers, else flashinfer_trtllm."""
    quant = layout.quant if isinstance(layout.quant, dict) else {}
    mixed = str(quant.get("quant_method", "")).lower() == "modelopt_mixed"
    layers = quant.get("quantized_layers") or {}
    w4a16 = any(".experts" in k and str((v or {}).get("quant_algo", "")).upper() == W4A16_NVFP4.algo
                for k, v in layers.items() if isinstance(v, dict))
    return "marlin" if mixed and w4a16 else "flashinfer_trtllm"


SGLANG_QWEN3_MOE = ModelServing(
    engine="sglang",
    model_type="qwen3_moe",
    mapper=WeightsMapper(),
    strip_prefix="",
    fused=(QKV, DENSE_GATE_UP),
    unquantized=(
        (r"\.mlp\.gate$", "SGLang's Qwen3-MoE router is a ReplicatedLinear built with quant_config=None "
                          "(qwen3_moe.py Qwen3MoeSparseMoeBlock.__init__; only modelslim configs quantize it)"),
    ),
    formats_only=(),
    # Qwen3MoeForCausalLM.packed_modules_mapping (the loader seeds the quant config's mapping from the class).
    packed_modules_mapping={"qkv_proj": QKV.pieces, "gate_up_proj": GATE_UP},
    expert_re=EXPERT_RE,
    gate_up=GATE_UP,
    kv_scale_params=("attn.k_scale", "attn.v_scale"),
    kv_note="SGLang's Qwen3MoeAttention holds its KV-cache scales on its RadixAttention (attn)",
    ignored=((r"\.mlp\.(gate_up|gate|up|down)_proj$",
              "SGLang 0.5.23 builds every Qwen3-MoE layer's mlp as Qwen3MoeSparseMoeBlock, ignoring mlp_only_layers "
              "(qwen3_moe.py Qwen3MoeDecoderLayer.stage_facts: sparse=True); load_weights skips this dense MLP's "
              "names and the layer's experts and router are never written"),),
    moe_runner=sglang_moe_runner,
)



# ---------------------------------------------------------------------- TensorRT-LLM

TRT_ROUTER_RE = re.compile(r".+\.mlp\.gate")
TRT_DENSE_MLP_RE = re.compile(r".+\.mlp\.(gate|up|down)_proj")


def _trt_module(layout: Layout, name: str, pieces: list[Linear], algo, exclude, numerics: bool) -> Refusal | None:
    if TRT_ROUTER_RE.fullmatch(name):
        quantized = next((p for p in pieces if p.fmt != "bf16"), None)
        return quantized and Refusal(quantized.tensor_name(), f"stored {quantized.fmt}, but TensorRT-LLM's "
                                     "Qwen3Gate is a bare BF16 weight copied as stored (modeling_qwen3_moe.py)")
    if TRT_DENSE_MLP_RE.fullmatch(name):
        return Refusal(pieces[0].tensor_name(), "TensorRT-LLM's Qwen3MoEDecoderLayer builds every layer's mlp as "
                                                "Qwen3MoE (mlp_only_layers / decoder_sparse_step are not read): this "
                                                "layer holds a dense MLP, so its experts find no w1/w2/w3 to load "
                                                "(modeling_qwen3_moe.py)")
    if name == "lm_head":  # settled only for the case our exports write: BF16 and excluded
        head = pieces[0]
        if head.fmt == "bf16" and (algo is None or trt_excluded(name, exclude)):
            return None
        return Refusal(head.tensor_name(), f"stored {head.fmt}{'' if algo is None else ', quant_algo ' + algo}: "
                                           "whether TensorRT-LLM's Qwen3-MoE lm_head takes the quant config was "
                                           "not read; only a BF16 lm_head that exclude_modules names is settled")
    method = trt_method(algo, trt_excluded(name, exclude))
    why = trt_why(algo, method, name)
    for piece in pieces:
        refusal = format_refusal(piece, method, name, why)
        if refusal:
            return refusal
    if method == NVFP4.engine_method and len(pieces) > 1 and numerics and layout.read is not None:
        return equal_scales(layout, pieces, NVFP4_SCALES, "NVFP4LinearMethod.load_weight_scales (linear.py)")
    return None


def replay_trtllm(layout: Layout, *, numerics: bool = True) -> EngineResult:
    """TensorRT-LLM's ``Qwen3MoeForCausalLM`` loading a ModelOpt export (module docstring)."""
    result = EngineResult("trtllm")
    if not replay_vanilla_experts_model(layout, result, _trt_module, expert_re=EXPERT_RE, fused=(QKV,),
                                        gate_up=GATE_UP, numerics=numerics):
        return result
    if layout.kv_scales:
        result.refusals.append(Refusal(sorted(layout.kv_scales)[0], "KV-cache scales: TensorRT-LLM's Qwen3-MoE "
                                                                    "KV-cache loading is not replayed by this check"))
    result.refusals.sort(key=lambda r: r.tensor)
    return result


# The spec's ``ServingSpec.rules``: engine -> rules.
SERVING = {"vllm": VLLM_QWEN3_MOE, "sglang": SGLANG_QWEN3_MOE, "trtllm": replay_trtllm}
