"""What each serving engine's GPT-OSS class does with our export (per-expert NVFP4 experts): the check's rules.

Read from the engines' sources as users install them, and observed by their own loaders on the tiny GPT-OSS
exports (``tools/conformance/drivers/{vllm,sglang}_gpt_oss.py``; cells ``gpt_oss-qformat-nvfp4``,
``gpt_oss-convert-default`` in docs/ENGINE_CONFORMANCE.md):

* vLLM 0.33.0 (PyPI wheel), ``model_executor/models/gpt_oss.py``: a ``quant_method: modelopt`` config takes
  ``GptOssModel._load_weights_other``. ``GptOssForCausalLM.hf_to_vllm_mapper`` renames
  ``.gate_up_proj.weight`` / ``.weight_scale`` / ``.input_scale`` to ``.w13_weight`` / ``.w13_weight_scale`` /
  ``.w13_input_scale`` (``down_proj`` likewise) but has no entry for ``.weight_scale_2``, which then matches no
  parameter and is skipped. The per-expert names go to ``_try_load_streamed_expert`` ->
  ``GptOssRoutedExperts.weight_loader``, which takes the packed path (``_load_packed_expert``) only for the
  MXFP4 and compressed-tensors NVFP4 methods; the ModelOpt NVFP4 method falls to ``_load_unquantized_expert``,
  which narrows and transposes the tensor as a BF16 ``[in, out]`` weight; ``_copy_to_expert`` then copies the
  transposed packed codes into the ``[out, in/2]`` parameter and raises on the shapes (observed on both GPT-OSS
  conformance cells: ``RuntimeError`` in ``load_weights``; only an ``out == in/2`` projection would land silently
  transposed, which no GPT-OSS has). ModelOpt's own fused layout fares no better there:
  ``gate_up_proj`` loads, ``gate_up_proj_weight_scale*`` match no mapping and are skipped.
* SGLang 0.5.23 (PyPI wheel), ``srt/models/gpt_oss.py``: ``GptOssDecoderLayer.__init__`` builds
  ``GptOssAttention`` without passing its ``quant_config`` (so ``qkv_proj``/``o_proj`` are BF16
  ``QKVParallelLinear``/``RowParallelLinear``): stored NVFP4/FP8 attention trips the Linear's weight-loader
  shape assert -- refused. A ModelOpt config takes ``GptOssForCausalLM._load_normal_weights``, whose expert
  mapping (``FusedMoE.make_expert_params_mapping_fused``) matches only the fused names
  ``experts.gate_up_proj`` / ``experts.down_proj`` (+ ``_bias``); per-expert ``experts.<e>.gate_up_proj.*``
  and our fused ``experts.gate_up_proj_bias`` match no parameter and are skipped without an error, so every
  routed-expert parameter keeps its initial value: the engine loads and **serves different numbers**.
  (ModelOpt's fused layout: the mapping's substring replace turns ``experts.gate_up_proj_weight_scale`` into
  ``experts.w13_weight_weight_scale``, no parameter, skipped.) Observed by SGLang's own loader: the calibrated
  export stops in ``load_weights`` at ``linear.py weight_loader``'s shape assert (a BF16 ``qkv_proj`` row of 64
  against 32 packed bytes); the converter's export loads with all 64 per-expert tensors and both fused bias tensors
  of each layer landing nowhere and every ``w13_*``/``w2_*`` parameter never written. Also observed: with
  ``--moe-runner-backend auto`` SGLang's ``arg_groups/model_overrides/gpt_oss.py _gpt_oss_overrides`` picks
  ``triton_kernel`` for a non-MXFP4 GPT-OSS config (``--quantization`` unset, triton_kernels installed), and
  ``ModelOptNvFp4FusedMoEMethod.apply`` (``modelopt_quant.py``) raises ``NotImplementedError`` for it at the first
  forward, naming ``flashinfer_cutlass``: a warning (``SGLANG_RUNNER``).
* TensorRT-LLM (PyTorch backend), NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/models/modeling_gpt_oss.py`` @
  050b6cb9 (``GptOssForCausalLM.load_weights`` -> ``load_hf_weights`` for HF names, i.e. any ``q_proj`` key;
  ``MLPBlock`` builds the experts with ``MoEWeightLoadingMode.FUSED_GATE_UP_PROJ``) and
  ``checkpoints/hf/gpt_oss_weight_mapper.py`` @ f79bd8c9 (``GptOssHfWeightMapper.handle_special_instance_module``,
  the same lookup): the MoE module's weights are read under the fused names only -- ``gate_up_proj`` /
  ``down_proj`` (+ ``_bias``; BF16, gate/up interleaved) or ``gate_up_proj_blocks`` / ``_scales`` (the source
  MXFP4). Per-expert ``experts.<e>.gate_up_proj.*`` give neither key, so the load raises ``KeyError``
  whatever the experts' format; ModelOpt's fused NVFP4 names are not read either (not replayed here).

So vLLM refuses a GPT-OSS export whose routed experts are NVFP4 (what the GPT-OSS recipes produce);
SGLang refuses quantized attention (the calibrated recipe) and otherwise silently mis-loads the per-expert
experts (the converter's default); TensorRT-LLM refuses any per-expert export.
"""

from __future__ import annotations

import math
import re

from ...check.layout import Layout
from ...check.report import Deviation, EngineResult, Refusal
from ...quant.schemes import NVFP4_TENSOR

EXPERT_RE = re.compile(r"(?P<module>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_up_proj|down_proj)")
ATTENTION_RE = re.compile(r".+\.self_attn\.(q|k|v|o)_proj")
REASONS = {
    "vllm": ("vLLM 0.33.0's GPT-OSS loads ModelOpt per-expert tensors through GptOssRoutedExperts."
             "_load_unquantized_expert (a BF16 [in, out] transpose; the packed path is only for MXFP4 and "
             "compressed-tensors NVFP4), whose _copy_to_expert then raises copying the transposed packed codes / "
             "block scales into the [out, in/2] / [out, in/16] expert parameter (RuntimeError, observed by vLLM's "
             "own loader: tools/conformance); hf_to_vllm_mapper has no weight_scale_2 entry either (gpt_oss.py "
             "GptOssModel._load_weights_other)"),
}
SGLANG_ATTENTION = ("SGLang 0.5.23's GptOssDecoderLayer builds GptOssAttention without a quant config, so its "
                    "QKVParallelLinear/RowParallelLinear are BF16 and their weight loader asserts on the stored "
                    "tensors (gpt_oss.py GptOssDecoderLayer.__init__)")
SGLANG_EXPERTS = ("SGLang 0.5.23's GPT-OSS maps only the fused experts.gate_up_proj/down_proj(+_bias) names; the "
                  "per-expert tensors and the expert biases match nothing and are skipped without an error, so "
                  "every routed-expert parameter is never written (gpt_oss.py GptOssForCausalLM._load_normal_weights)")


def _replay(engine: str):
    def replay(layout: Layout, *, numerics: bool = True) -> EngineResult:
        result = EngineResult(engine)
        for name, linear in sorted(layout.linears.items()):
            if EXPERT_RE.fullmatch(name) and linear.fmt != "bf16":
                result.refusals.append(Refusal(linear.tensor_name(), f"stored {linear.fmt}: {REASONS[engine]}"))
        if not result.refusals:
            result.refusals.append(Refusal("config.json", f"modelopt-k3-check knows {engine}'s GPT-OSS rules only "
                                                          "for NVFP4 routed experts (refused above)"))
        return result

    return replay


SGLANG_RUNNER = ("NVFP4 routed experts: with --moe-runner-backend auto SGLang 0.5.23 picks triton_kernel for GPT-OSS "
                 "(arg_groups/model_overrides/gpt_oss.py _gpt_oss_overrides), which ModelOptNvFp4FusedMoEMethod.apply "
                 "refuses at the first forward (NotImplementedError naming --moe-runner-backend flashinfer_cutlass; "
                 "observed by the conformance driver)")


def replay_sglang(layout: Layout, *, numerics: bool = True) -> EngineResult:
    """SGLang's GPT-OSS: quantized attention refused; per-expert experts skipped (served numbers differ)."""
    result = EngineResult("sglang")
    modules: dict[str, str] = {}
    for name, linear in sorted(layout.linears.items()):
        if ATTENTION_RE.fullmatch(name) and linear.fmt != "bf16":
            result.refusals.append(Refusal(linear.tensor_name(), f"stored {linear.fmt}: {SGLANG_ATTENTION}"))
        m = EXPERT_RE.fullmatch(name)
        if m:
            modules.setdefault(m["module"], linear.fmt)
    result.deviations += [Deviation(module, f"per-expert {fmt} experts land in no parameter: {SGLANG_EXPERTS}",
                                    math.inf) for module, fmt in modules.items()]
    if NVFP4_TENSOR.name in modules.values():
        result.warnings.append(SGLANG_RUNNER)
    if not result.refusals and not result.deviations:
        result.refusals.append(Refusal("config.json", "modelopt-k3-check knows SGLang's GPT-OSS rules only for "
                                                      "per-expert routed experts (fused exports are not replayed)"))
    return result


TRT_REASON = ("TensorRT-LLM's GPT-OSS reads the MoE's weights under the fused names gate_up_proj/down_proj (BF16) "
              "or gate_up_proj_blocks/_scales (MXFP4) only; per-expert experts.<e>.* names give neither and the "
              "load raises KeyError (modeling_gpt_oss.py GptOssForCausalLM.load_hf_weights, "
              "gpt_oss_weight_mapper.py handle_special_instance_module)")


def replay_trtllm(layout: Layout, *, numerics: bool = True) -> EngineResult:
    """TensorRT-LLM's GPT-OSS loader: one refusal per MoE module holding per-expert tensors (module docstring)."""
    result = EngineResult("trtllm")
    first: dict[str, str] = {}
    for name, linear in sorted(layout.linears.items()):
        m = EXPERT_RE.fullmatch(name)
        if m:
            first.setdefault(m["module"], linear.tensor_name())
    result.refusals += [Refusal(tensor, TRT_REASON) for tensor in first.values()]
    if not result.refusals:
        result.refusals.append(Refusal("config.json", "modelopt-k3-check knows TensorRT-LLM's GPT-OSS rules only for "
                                                      "per-expert routed experts (refused: fused experts.gate_up_proj "
                                                      "exports are not replayed)"))
    return result


# The spec's ``ServingSpec.rules``: engine -> rules.
SERVING = {"vllm": _replay("vllm"), "sglang": replay_sglang, "trtllm": replay_trtllm}
