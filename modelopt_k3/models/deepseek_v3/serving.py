"""How each serving engine's DeepSeek-V3 class loads a ModelOpt export: the rules ``modelopt-k3-check`` replays.

One snapshot per engine (the project's pins; facts and functions, not their code):

* vLLM 0.33.0 (the PyPI wheel): ``vllm/model_executor/models/deepseek_v2.py`` (``DeepseekV3ForCausalLM`` is
  ``DeepseekV2ForCausalLM``). ``DeepseekV2ForCausalLM.__init__`` adds ``fused_qkv_a_proj: [q_a_proj,
  kv_a_proj_with_mqa]`` to ``packed_modules_mapping`` when ``q_lora_rank`` is set (next to the class's
  ``gate_up_proj``); ``DeepseekV2MLAAttention.__init__`` then builds ``fused_qkv_a_proj`` as one
  ``DeepSeekV2FusedQkvAProjLinear`` (a ``MergedColumnParallelLinear``, one quant method for both shards;
  ``quant_utils.is_layer_skipped`` raises when only one shard is excluded) and ``q_b_proj``, ``kv_b_proj``,
  ``o_proj`` with the quant config; ``DeepseekV2MLP`` (dense layers and shared experts) fuses gate/up into
  ``gate_up_proj``; ``DeepseekV2MoE.__init__`` builds the router ``GateLinear`` *without* a quant config and
  the routed experts as one ``FusedMoE`` (``DeepseekV2Model.load_weights``: ``stacked_params_mapping`` and
  ``fused_moe_make_expert_params_mapping(gate_proj, down_proj, up_proj)``); ``lm_head`` is a
  ``ParallelLMHead`` built with the quant config. ``load_weights`` skips every name
  ``utils.get_spec_layer_idx_from_weight_name`` gives an MTP index (``model.layers.{num_hidden_layers + j}``,
  only when ``num_nextn_predict_layers`` > 0; otherwise such a name has no parameter: ``KeyError``). The MTP
  drafter (``deepseek_mtp.py DeepSeekMTP``) loads those layers with the same quant config: replayed with this
  class's rules on the MTP layers alone (``_mtp_drafter``; serving rule ``mtp-drafter-format``).
  ``layers/mla.py`` ``MultiHeadLatentAttentionWrapper`` holds the ``MLAAttention`` as ``mla_attn``, which the
  ModelOpt config gives its KV-cache method (``modelopt.py get_quant_method``), but ModelOpt's
  ``self_attn.{k,v}_proj.{k,v}_scale`` never land there: ``models/utils.py AutoWeightsLoader.load_weights`` first
  applies the quant config's cache-scale mapper (``base_config.py get_cache_scale_mapper``: ->
  ``self_attn.attn.{k,v}_scale``), and ``load_weights``' ``weight_utils.maybe_remap_kv_scale_name`` then maps that
  name to ``self_attn.attn.attn.{k,v}_scale``, no parameter: dropped with a warning, the FP8 KV cache (what
  ``--kv-cache-dtype auto`` resolves to for the export) served with 1.0 (observed by vLLM's own loader,
  ``tools/conformance``; the generic rule is ``check/engines/vllm.py CACHE_SCALE_MAPPER``). ``attention/mla_attention.py split_kv_b_proj`` reads
  ``kv_b_proj`` through ``quant_utils.get_and_maybe_dequant_weights``: plain weights and FP8 are read directly,
  any other method by running the quantized layer on an identity matrix (NVFP4 W4A4 quantizes that identity
  too) -- not replayed, so a quantized ``kv_b_proj`` is refused as unsettled. (The AITER fused shared expert
  is ROCm only.)
* SGLang 0.5.23 (the PyPI wheel): ``sglang/srt/models/deepseek_v2.py`` and
  ``models/deepseek_common/deepseek_weight_loader.py``. ``DeepseekV2AttentionMLA.__init__`` builds one
  ``ReplicatedLinear`` ``fused_qkv_a_proj_with_mqa`` (quant config) when ``q_lora_rank`` is set and
  ``DeepseekV2ForCausalLM.__init__`` registers it in the quant config's packed mapping;
  ``DeepseekV2WeightLoaderMixin.do_load_weights`` caches ``q_a_proj`` and ``kv_a_proj_with_mqa`` tensors and
  loads ``torch.cat([q_a, kv_a])`` -- except for 0-d tensors (per-tensor ``weight_scale_2``, ``input_scale``),
  where it loads q_a_proj's alone: kv_a_proj_with_mqa's rows are served with q_a_proj's per-tensor scales.
  ``MoEGate`` is a bare ``nn.Parameter`` (no quant method, whatever the exclusions say); ``DeepseekV2MLP`` has
  ``gate_up_proj``; experts via ``FusedMoE.make_expert_params_mapping``; MTP names
  (``model.layers.{>= num_hidden_layers}``) are skipped (``NextNDisabledConfig`` and the ``end_layer`` test).
  KV scales: the loader itself renames ``k_proj``/``v_proj`` to ``attn_mqa`` (the ``RadixAttention`` that gets
  ``ModelOptFp8KVCacheMethod`` when the config names a ``kv_cache_quant_algo``), no
  ``maybe_remap_kv_scale_name``; the MHA prefill's ``attn_mha`` gets the same method and keeps 1.0 (its scales are
  never loaded), which the SM100 ``trtllm_mla`` prefill quantizes K/V with: a deviation (``_sglang_mha_kv_scales``;
  observed by SGLang's own loader, ``tools/conformance``). ``post_load_weights`` reads ``kv_b_proj.weight`` itself to build
  ``w_kc``/``w_vc``, dequantizing only float8 weights (and AWQ): an NVFP4 ``kv_b_proj`` is refused.
  ``DeepseekV2ForCausalLM.shared_experts_fusion_disable_reason`` fuses the shared expert into the routed
  experts (expert ``n_routed_experts``) for a ``DeepseekV3ForCausalLM`` config with 256 routed experts and 1
  shared expert unless an ``exclude_modules`` entry names a shared expert (``ModelOptFp4Config.
  can_fuse_shared_expert``) -- and then the device capability, EP size, SBO/TBO/DeepEP and the MoE runner
  (``moe_runner/flashinfer_trtllm.py`` asserts no fused shared experts) decide: not settled here, refused.
* TensorRT-LLM (PyTorch backend): NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/models/modeling_deepseekv3.py`` @
  000561df (the code index's stored version; newer builds moved the loading into a weight-mapper class, not
  read). ``DeepseekV3Attention`` builds ``kv_a_proj_with_mqa`` with ``q_lora_rank`` extra rows (q_a_proj and
  kv_a_proj_with_mqa fused, q_a first) and the quant config; ``DeepseekV3ForCausalLM.load_weights`` copies only
  the two pieces' ``weight`` (and ``weight_scale_inv``, block FP8) into it, so a per-tensor-scaled piece loads
  no scales; ``kv_b_proj`` is read raw (``weight`` and, for a module with ``weight_scale``, the
  ``weight_scale_inv`` an NVFP4 export does not have), or dequantized from ``weight_scale_inv`` when
  ``is_module_excluded_from_quantization("kv_b_proj")`` (the bare name) matches; ``DeepseekV3Gate`` is a bare
  ``weight`` parameter copied as stored; experts per expert (``gate_proj``/``up_proj``/``down_proj`` renamed
  ``w1``/``w3``/``w2``), generic NVFP4 rules in ``check/engines/trtllm.py``; the loader walks the model's own
  modules, so checkpoint MTP layers are read only when an MTP ``spec_config`` builds them.
"""

from __future__ import annotations

import re
from dataclasses import replace

from ...check.engines.base import Fused, ModelServing, WeightsMapper, kv_deviations
from ...check.engines.sglang import SGLANG
from ...check.engines.trtllm import (
    NVFP4_SCALES,
    equal_scales,
    format_refusal,
    replay_vanilla_experts_model,
    trt_excluded,
    trt_method,
    trt_why,
)
from ...check.engines.vllm import VLLM
from ...check.layout import Layout, Linear
from ...check.report import NO_DRAFTER, Deviation, EngineResult, Refusal
from ...quant.schemes import NVFP4, scheme_of_method

EXPERT_RE = r"(?P<module>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>(?:gate|up|down)_proj)"
GATE_UP = ("gate_proj", "up_proj")
QKV_A = ("q_a_proj", "kv_a_proj_with_mqa")
ROUTER = r"\.mlp\.gate$"
LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")

VLLM_KV_B = ("vLLM's MLA reads kv_b_proj through get_and_maybe_dequant_weights, which dequantizes any method but "
             "FP8 by running the quantized layer on an identity matrix (NVFP4 W4A4 quantizes that identity too; "
             "attention/mla_attention.py split_kv_b_proj): not replayed by this check, unsettled")

VLLM_DEEPSEEK_V3 = ModelServing(
    engine="vllm",
    model_type="deepseek_v3",
    mapper=WeightsMapper(),
    strip_prefix="",
    fused=(Fused("fused_qkv_a_proj", QKV_A), Fused("gate_up_proj", GATE_UP)),
    unquantized=((ROUTER, "vLLM's DeepSeek-V3 router is a GateLinear built without a quant config "
                          "(deepseek_v2.py DeepseekV2MoE.__init__)"),),
    formats_only=((r"\.self_attn\.kv_b_proj$", (), VLLM_KV_B),),
    # DeepseekV2ForCausalLM.packed_modules_mapping with __init__'s fused_qkv_a_proj (q_lora_rank set).
    packed_modules_mapping={"gate_up_proj": GATE_UP, "fused_qkv_a_proj": QKV_A},
    expert_re=EXPERT_RE,
    gate_up=GATE_UP,
    kv_scale_params=("mla_attn.mla_attn.k_scale", "mla_attn.mla_attn.v_scale"),
    kv_note="vLLM's DeepSeek-V3 MLA holds its KV-cache scales on self_attn.mla_attn.mla_attn, but AutoWeightsLoader's "
            "cache-scale mapper (base_config.py QuantizationConfig.get_cache_scale_mapper) has renamed ModelOpt's "
            "self_attn.{k,v}_proj.{k,v}_scale to self_attn.attn.{k,v}_scale before deepseek_v2.py load_weights' "
            "maybe_remap_kv_scale_name sees it",
)

SGLANG_DEEPSEEK_V3 = ModelServing(
    engine="sglang",
    model_type="deepseek_v3",
    mapper=WeightsMapper(),
    strip_prefix="",
    fused=(Fused("fused_qkv_a_proj_with_mqa", QKV_A, merged=False), Fused("gate_up_proj", GATE_UP)),
    unquantized=((ROUTER, "SGLang's DeepSeek-V3 router MoEGate is a bare nn.Parameter with no quant method "
                          "(deepseek_v2.py MoEGate)"),),
    formats_only=((r"\.self_attn\.kv_b_proj$", (),
                   "SGLang's DeepSeek-V3 post_load_weights builds w_kc/w_vc from kv_b_proj.weight itself, "
                   "dequantizing only float8 (and AWQ) weights (deepseek_weight_loader.py post_load_weights): "
                   "NVFP4 codes would be split as values, and a ModelOpt FP8_PB_WO kv_b_proj (weight_scale, not "
                   "weight_scale_inv) is not replayed here, unsettled"),),
    # DeepseekV2ForCausalLM.__init__ -> quant_config.update_packed_modules_mapping.
    packed_modules_mapping={"fused_qkv_a_proj_with_mqa": QKV_A},
    expert_re=EXPERT_RE,
    gate_up=GATE_UP,
    kv_scale_params=("attn_mqa.k_scale", "attn_mqa.v_scale"),
    kv_note="SGLang's DeepSeek-V3 MLA holds its KV-cache scales on its RadixAttention attn_mqa (a KV-cache method "
            "only when the config names a kv_cache_quant_algo)",
    # do_load_weights: a {k,v}_scale name without a parameter has "{k,v}_proj" replaced by "attn_mqa".
    kv_scale_rename=lambda name: name.replace(f"{name[-7]}_proj", "attn_mqa") if name.endswith(("k_scale", "v_scale"))
    else name,
)


# ---------------------------------------------------------------------- MTP layers (num_nextn_predict_layers)


def _mtp_split(layout: Layout) -> tuple[Layout, list[str]]:
    """``layout`` without the Linears / KV scales of layers ``>= num_hidden_layers`` (and those names)."""
    n = int(layout.config.get("num_hidden_layers", 0) or 0)

    def mtp(name: str) -> bool:
        m = LAYER_RE.match(name)
        return m is not None and int(m[1]) >= n

    dropped = sorted(k for k in (*layout.linears, *layout.kv_scales) if mtp(k))
    if not dropped:
        return layout, []
    kept = replace(layout, linears={k: v for k, v in layout.linears.items() if not mtp(k)},
                   kv_scales={k: v for k, v in layout.kv_scales.items() if not mtp(k)})
    return kept, dropped


def _mtp_layers(names: list[str]) -> str:
    return ", ".join(sorted({f"model.layers.{LAYER_RE.match(n)[1]}" for n in names}))


def _mtp_drafter(layout: Layout, mtp: list[str], engine, serving: ModelServing, numerics: bool) -> list[Refusal]:
    """The MTP layers as the engine's drafter loads them (vLLM ``deepseek_mtp.py DeepSeekMTP``, SGLang
    ``deepseek_nextn.py DeepseekV3ForCausalLMNextN``): built with the checkpoint's own quant config, so the main
    model's rules apply to them as stored. What they refuse is the drafter not loading (serving rule
    mtp-drafter-format: an MTP layer quantized while the configs still exclude it)."""
    names = set(mtp)
    drafter = replace(layout, linears={k: v for k, v in layout.linears.items() if k in names},
                      kv_scales={k: v for k, v in layout.kv_scales.items() if k in names})
    result = engine.replay(drafter, serving, numerics=numerics)
    return [Refusal(r.tensor, f"MTP drafter: {r.reason}", verdict=NO_DRAFTER, rule="mtp-drafter-format")
            for r in result.refusals]


def replay_vllm(layout: Layout, *, numerics: bool = True) -> EngineResult:
    """vLLM's ``DeepseekV3ForCausalLM`` (module docstring): MTP layers skipped when the config declares them."""
    kept, mtp = _mtp_split(layout)
    result = VLLM.replay(kept, VLLM_DEEPSEEK_V3, numerics=numerics)
    if mtp and not int(layout.config.get("num_nextn_predict_layers", 0) or 0):
        first = next(n for n in sorted(layout.linears) if n in mtp)
        result.refusals.append(Refusal(layout.linears[first].tensor_name(), (
            "a layer past num_hidden_layers while num_nextn_predict_layers is 0: vLLM's load_weights treats it as "
            "no MTP layer and finds no parameter for it (deepseek_v2.py load_weights, KeyError)")))
    elif mtp:
        result.warnings.append(f"{_mtp_layers(mtp)}: MTP layers, skipped by the main model's load_weights; vLLM's "
                               "MTP drafter (deepseek_mtp.py) loads them with the same quant config (replayed)")
        result.refusals += _mtp_drafter(layout, mtp, VLLM, VLLM_DEEPSEEK_V3, numerics)
    return result


# ---------------------------------------------------------------------- SGLang


def _sglang_fuses_shared_expert(layout: Layout, exclude: list) -> bool:
    """``shared_experts_fusion_disable_reason``'s config-only part (ModelOpt NVFP4, no forcing flags)."""
    cfg = layout.config
    arch = (cfg.get("architectures") or [None])[0]
    return (arch == "DeepseekV3ForCausalLM" and cfg.get("n_routed_experts") == 256
            and cfg.get("n_shared_experts") == 1
            and not any("shared_expert" in str(e) and "shared_expert_gate" not in str(e) for e in exclude))


def _sglang_qkv_a_scales(layout: Layout, module: str, pieces: dict[str, Linear]) -> list[Deviation]:
    """0-d per-tensor scales of the fused pieces: SGLang keeps q_a_proj's, so kv_a_proj_with_mqa is off by s_q/s_kv."""
    q, kv = pieces["q_a_proj"], pieces["kv_a_proj_with_mqa"]
    scheme = scheme_of_method(q.fmt)
    if scheme is None or q.fmt != kv.fmt:
        return []
    keys = [k for k in (scheme.weights.global_scale_key, "input_scale" if scheme.inputs is not None else None) if k]
    out = []
    for key in keys:
        if key not in q.tensors or key not in kv.tensors or q.tensors[key].shape != () or kv.tensors[key].shape != ():
            continue
        sq, skv = float(layout.value(q.tensor_name(key))), float(layout.value(kv.tensor_name(key)))
        if sq != skv:
            out.append(Deviation(module, f"{key} of q_a_proj {sq:.6g} and kv_a_proj_with_mqa {skv:.6g}: SGLang's "
                                         "do_load_weights loads only q_a_proj's 0-d scale into fused_qkv_a_proj_with_mqa",
                                 abs(sq / skv - 1.0)))
    return out


def replay_sglang(layout: Layout, *, numerics: bool = True) -> EngineResult:
    """SGLang's ``DeepseekV3ForCausalLM`` (module docstring)."""
    kept, mtp = _mtp_split(layout)
    result = SGLANG.replay(kept, SGLANG_DEEPSEEK_V3, numerics=numerics)
    q = (layout.hf_quant or {}).get("quantization") or layout.quant or {}
    exclude = q.get("exclude_modules") or q.get("ignore") or []
    if _sglang_fuses_shared_expert(layout, exclude):
        first = min((n for n in kept.linears if ".mlp.shared_experts." in n), default=None)
        if first is not None:
            result.refusals.append(Refusal(kept.linears[first].tensor_name(), (
                "DeepseekV3ForCausalLM with 256 routed experts and 1 shared expert, none excluded: SGLang fuses the "
                "shared expert into the routed experts (shared_experts_fusion_disable_reason) depending on the "
                "device, EP size, SBO/TBO/DeepEP and the MoE runner (flashinfer_trtllm asserts no fused shared "
                "experts); this check does not replay that path: unsettled")))
    if numerics and kept.read is not None:
        fused = "fused_qkv_a_proj_with_mqa"
        by_parent: dict[str, dict[str, Linear]] = {}
        for name, lin in kept.linears.items():
            parent, _, last = name.rpartition(".")
            if last in QKV_A:
                by_parent.setdefault(parent, {})[last] = lin
        for parent, pieces in sorted(by_parent.items()):
            if len(pieces) == 2:
                module = f"{parent}.{fused}"
                result.deviations = [d for d in result.deviations if d.module != module]
                result.deviations += _sglang_qkv_a_scales(kept, module, pieces)
    result.deviations += _sglang_mha_kv_scales(kept, q, {d.module for d in result.deviations}, numerics)
    if mtp:
        result.warnings.append(f"{_mtp_layers(mtp)}: past num_hidden_layers, skipped by the main model's "
                               "do_load_weights; SGLang's NextN drafter (deepseek_nextn.py) loads them with the same "
                               "quant config (replayed)")
        result.refusals += _mtp_drafter(layout, mtp, SGLANG, SGLANG_DEEPSEEK_V3, numerics)
    result.refusals.sort(key=lambda r: r.tensor)
    return result


# SGLang 0.5.23, observed by its own loader (tools/conformance, cell deepseek_v3-qformat-nvfp4-kv_fp8) and read in the
# wheel: DeepseekV2AttentionMLA.__init__ (models/deepseek_v2.py) builds two RadixAttentions with the quant config,
# attn_mqa and attn_mha, so both get the ModelOpt KV-cache method and k_scale/v_scale parameters; do_load_weights
# (models/deepseek_common/deepseek_weight_loader.py) renames a ModelOpt {k,v}_proj.{k,v}_scale to attn_mqa only, so
# attn_mha's stay unloaded and kv_cache.py BaseKVCacheMethod.process_weights_after_loading sets them to 1.0. The MHA
# prefill (deepseek_common/attention_forward_methods/forward_mha.py) runs attn_mha, and on SM100 (the DeepSeek
# override's default attention backend there is trtllm_mla: arg_groups/model_overrides/deepseek_v2.py) with an FP8
# KV cache (what --kv-cache-dtype auto resolves to for a kv_cache_quant_algo FP8 config: mem_cache/kv_cache_dtype.py)
# the ragged prefill quantizes K and V with attn_mha's scales (trtllm_mla_backend.py _quantize_fp8_qkv).
SGLANG_MHA_KV = ("SGLang's DeepSeek-V3 loads it into attn_mqa only (deepseek_weight_loader.py do_load_weights); the "
                 "MHA prefill's attn_mha, built with the KV-cache method too (deepseek_v2.py DeepseekV2AttentionMLA), "
                 "keeps 1.0, and with the FP8 KV cache --kv-cache-dtype auto resolves to for this export "
                 "(mem_cache/kv_cache_dtype.py) the SM100 default trtllm_mla prefill quantizes K/V with attn_mha's "
                 "scales (trtllm_mla_backend.py _quantize_fp8_qkv)")


def _sglang_mha_kv_scales(layout: Layout, q: dict, already: set[str], numerics: bool) -> list[Deviation]:
    """The KV scales SGLang loads for decode (attn_mqa) but not for the MHA prefill (attn_mha): served with 1.0."""
    if not q.get("kv_cache_quant_algo") and not layout.config.get("quantization_config", {}).get("kv_cache_scheme"):
        return []
    reasons = {name: SGLANG_MHA_KV for name in sorted(layout.kv_scales)
               if name not in already and name.endswith((".k_proj.k_scale", ".v_proj.v_scale"))}
    return kv_deviations(layout, reasons, numerics)


# ---------------------------------------------------------------------- TensorRT-LLM

# The pieces TensorRT-LLM's DeepseekV3 fuses: q_a_proj into kv_a_proj_with_mqa's module, the dense gate/up.
TRT_FUSED = (Fused("kv_a_proj_with_mqa", QKV_A), Fused("gate_up_proj", GATE_UP))


def _trt_module(layout: Layout, name: str, pieces: list[Linear], algo, exclude, numerics: bool) -> Refusal | None:
    if re.search(ROUTER, name):
        quantized = next((p for p in pieces if p.fmt != "bf16"), None)
        return quantized and Refusal(quantized.tensor_name(), f"stored {quantized.fmt}, but TensorRT-LLM's "
                                     "DeepseekV3Gate is a bare weight parameter copied as stored (modeling_deepseekv3.py)")
    if name == "lm_head":  # as for Qwen3-MoE: only a BF16, excluded lm_head is settled
        head = pieces[0]
        if head.fmt == "bf16" and (algo is None or trt_excluded(name, exclude)):
            return None
        return Refusal(head.tensor_name(), f"stored {head.fmt}: whether TensorRT-LLM's DeepSeek-V3 lm_head takes "
                                           "the quant config was not read; only a BF16 lm_head exclude_modules "
                                           "names is settled")
    method = trt_method(algo, trt_excluded(name, exclude))
    why = trt_why(algo, method, name)
    last = name.rpartition(".")[2]
    if last == "kv_b_proj" and exclude.fnmatch_any("kv_b_proj", case=True):
        return Refusal(pieces[0].tensor_name(), "an exclude_modules entry matches the bare name kv_b_proj, so "
                                                "TensorRT-LLM's load_weights dequantizes kv_b_proj from a "
                                                "weight_scale_inv this export does not have (KeyError)")
    for piece in pieces:
        refusal = format_refusal(piece, method, name, why)
        if refusal:
            return refusal
    if method != "bf16" and last == "kv_a_proj_with_mqa":
        return Refusal(pieces[0].tensor_name(), f"TensorRT-LLM builds the fused {name} (q_a_proj + "
                                                f"kv_a_proj_with_mqa) as {method}, but load_weights copies only the "
                                                "pieces' weight (and block-FP8 weight_scale_inv): its per-tensor "
                                                "and block scales are never loaded")
    if method != "bf16" and last == "kv_b_proj":
        return Refusal(pieces[0].tensor_name(), f"TensorRT-LLM builds kv_b_proj as {method} and load_weights then "
                                                "reads its scales from weight_scale_inv, which an NVFP4 export "
                                                "does not have (KeyError)")
    if method == NVFP4.engine_method and len(pieces) > 1 and numerics and layout.read is not None:
        return equal_scales(layout, pieces, NVFP4_SCALES, "NVFP4LinearMethod.load_weight_scales (linear.py)")
    return None


def replay_trtllm(layout: Layout, *, numerics: bool = True) -> EngineResult:
    """TensorRT-LLM's ``DeepseekV3ForCausalLM.load_weights`` (module docstring)."""
    result = EngineResult("trtllm")
    kept, mtp = _mtp_split(layout)
    if not replay_vanilla_experts_model(kept, result, _trt_module, expert_re=EXPERT_RE, fused=TRT_FUSED,
                                        gate_up=GATE_UP, numerics=numerics):
        return result
    if kept.kv_scales:
        result.refusals.append(Refusal(sorted(kept.kv_scales)[0], "KV-cache scales: TensorRT-LLM's DeepSeek-V3 "
                                                                  "MLA KV-cache loading is not replayed by this check"))
    if mtp:
        result.warnings.append(f"{_mtp_layers(mtp)}: never read by load_weights (it walks the model's own modules; "
                               "MTP layers are built only for an MTP spec_config, not replayed)")
    result.refusals.sort(key=lambda r: r.tensor)
    return result


# The spec's ``ServingSpec.rules``: engine -> rules.
SERVING = {"vllm": replay_vllm, "sglang": replay_sglang, "trtllm": replay_trtllm}
