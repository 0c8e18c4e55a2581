"""How each serving engine's Kimi-K3 class loads a checkpoint: the rules ``modelopt-k3-check`` replays.

One snapshot per engine, as users install it:

* vLLM 0.33.0 (the PyPI wheel): ``vllm/models/kimi_k3/__init__.py`` (``nvidia/`` off ROCm/TPU),
  ``nvidia/model.py`` (``KimiLinearModel.packed_modules_mapping`` and ``load_weights``'
  ``stacked_params_mapping``; ``KimiMoE``: ``GateLinear`` router without a quant config, latent
  projections built with it; ``KimiDecoderLayer``: attention-residual projections with
  ``quant_config=None``; ``KimiK3ForConditionalGeneration.hf_to_vllm_mapper``), ``nvidia/kda.py``
  (``KimiK3DeltaAttention.__init__``: ``in_proj_qkvgfab`` padded per TP rank to 16 rows, or to 128
  when it resolves to FP8_PB_WO), ``nvidia/mla.py`` (``fused_qkv_a_g_proj`` with the output gate),
  ``nvidia/latent_moe_runner.py`` (the fused tail only for an unquantized ``up_proj``), and
  ``model_executor/layers/fused_moe/oracle/nvfp4.py`` ``select_nvfp4_moe_backend`` (FLASHINFER_TRTLLM
  first; ``experts/trtllm_nvfp4_moe.py`` runs ``situ``): NVFP4 K3 experts need no serve flag.
* SGLang 0.5.23 (the PyPI wheel): ``sglang/srt/models/kimi_k3.py``
  (``KimiK3ForConditionalGeneration.{packed_modules_mapping, hf_to_sglang_mapper, __init__, load_weights}``:
  the language model is built with prefix ``""`` for ModelOpt configs and ``language_model.`` is dropped
  from checkpoint names; ``KimiK3LinearForCausalLM.{load_weights, post_load_weights}``:
  ``_maybe_map_fp8_pb_scale_name`` maps FP8_PB_WO ``weight_scale`` to ``weight_scale_inv``,
  ``fused_qkv_a_proj_with_mqa`` is filled by rows, ``kv_b_proj`` dequantized by ``_get_k3_dense_weight``
  (block FP8 only); ``KimiK3MoE``: router ``MoEGate`` and -- the ModelOpt configs lacking
  ``supports_kimi_k3_quantized_latent_projections`` -- latent projections without a quant config;
  ``KimiK3DeltaAttention``: ``fused_qkvg_proj``, the ``[f_a | b]`` merge only for BF16 or block FP8),
  ``deepseek_v2.py`` (``fused_qkv_a_proj_with_mqa`` is one ``ReplicatedLinear``), ``layers/quantization/
  modelopt_quant.py`` (``ModelOptNvFp4FusedMoEMethod.apply``: ``situ`` only on the ``flashinfer_trtllm``
  / ``flashinfer_megamoe`` runner backends) and ``layers/quantization/fp8.py``
  (``validate_block_quant_shapes``: each output partition of a merged block-FP8 Linear divisible by 128).
* TensorRT-LLM: NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/models/modeling_kimi_linear.py`` @ cf328e85
  (``KimiK3MoERuntime._resolve_routed_quant_config``, ``_K3_EXPERT_CKPT_SPECS``, ``load_weights``), and a newer
  snapshot of the same file (a fork in the code index, 145,529 characters, no commit id recorded; its resolution
  functions are replayed, unmodified, by ``tools/conformance/trtllm.py`` over the conformance exports and agree
  with the rules below call for call): ``resolve_attention_quant_config`` (each attention projection looked
  up as ``<prefix>layers.{i}.self_attn.<proj>``: excluded -> unquantized; aliases in ``quantized_layers`` must
  agree, else ``ValueError``; MIXED_PRECISION without an entry -> unquantized; anything but unquantized or
  ``FP8_BLOCK_SCALES`` -> ``ValueError``, and ``FP8_BLOCK_SCALES`` with a ``group_size`` other than 128 too;
  exclusion is ``QuantConfig.is_module_excluded_from_quantization``: the name or an ancestor, ``x.*`` matching
  ``x`` itself, ``re:`` entries as regexes), called for KDA q/k/v/g/o (``KimiLinearDecoderLayer.__init__``) and
  MLA q_a/kv_a/q_b/kv_b/g/o (``KimiMLARuntime.__init__``); FP8 attention is read as FP8 codes with 128x128
  scales (``_Fp8BlockScaleWeightReadLinear``), no longer dequantized; ``KimiKDALinearAttention`` takes its
  five FP8 projections together or not at all and, like MLA ``kv_b_proj``, only 128-multiple dims (issue 30's
  replay; Kimi-K3's real dims pass, the 64-wide tiny model's do not);
  ``KimiK3MoERuntime._resolve_routed_quant_config`` checks ``exclude_modules`` (name and ancestors) *before*
  ``quantized_layers`` and returns no quant_algo for an excluded bank, which ``_k3_expert_ckpt_spec`` refuses
  with ``NotImplementedError``; NVFP4 routed experts are read by the generic NVFP4 fused-MoE method, whose
  ``load_expert_fc31_alpha_nvfp4`` / ``load_expert_fc31_input_scale_nvfp4`` (``_torch/modules/fused_moe/
  quantization.py``) assert each expert's w1 and w3 scales equal (serving rule ``trtllm-fc31-scales``). No PyPI
  release has Kimi-K3.

The engines' generic ModelOpt rules (config parsing, exclusions, scale use) are in
``modelopt_k3/check/engines``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ...check.engines.base import Fused, ModelServing, Refuse, WeightsMapper, kv_deviations
from ...check.engines.excludes import ExcludeIndex
from ...check.engines.trtllm import (
    FP8_BLOCK_SCALES,
    config_json_group_size_warning,
    fc31_scales,
    trt_algo,
    trt_excluded_or_ancestor,
)
from ...check.layout import Layout, Linear
from ...check.report import EngineResult, Refusal
from ...quant.schemes import FP8, FP8_PB_WO, NVFP4

EXPERT_RE = r"(?P<module>.+\.block_sparse_moe\.experts)\.(?P<expert>\d+)\.(?P<proj>w[123])"
GATE_UP = ("w1", "w3")  # fused into w13 by both engines' make_expert_params_mapping(w1, w2, w3)
BLOCK_FP8 = (FP8_PB_WO.engine_method,)

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
        # MLA q_a/kv_a, plus the output gate g_proj when mla_use_output_gate (the only MLA with a g_proj).
        Fused("fused_qkv_a_g_proj", ("q_a_proj", "kv_a_proj_with_mqa", "g_proj")),
        Fused("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa")),
        Fused("gate_up_proj", ("gate_proj", "up_proj")),  # dense MLP and shared experts (KimiMLP)
    ),
    unquantized=(
        (r"_res_proj$", "vLLM's K3 builds the attention-residual projections with quant_config=None "
                        "(model.py KimiDecoderLayer, KimiLinearModel)"),
        (r"\.block_sparse_moe\.gate$", "vLLM's K3 router is a GateLinear without quant_config (model.py KimiMoE)"),
    ),
    formats_only=(
        (r"\.self_attn\.in_proj_qkvgfab$", BLOCK_FP8,
         "vLLM's K3 fuses KDA q/k/v/g/f_a/b into in_proj_qkvgfab and pads it per TP rank with an extra shard "
         "(to 16 rows, to 128 for FP8_PB_WO): with per-tensor scales that shard's never-loaded "
         "weight_scale_2/input_scale enter the max() over shards (nvidia/kda.py KimiK3DeltaAttention)"),
    ),
    # KimiLinearModel.packed_modules_mapping (its SupportsQuant mapping; g_proj is absent from
    # in_proj_qkvgfab, so a per-shard lookup of that fused name never sees g_proj).
    packed_modules_mapping={
        "gate_up_proj": ("gate_proj", "up_proj"),
        "in_proj_qkvgfab": ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj"),
        "conv1d": ("q_conv1d", "k_conv1d", "v_conv1d"),
        "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
        "fused_qkv_a_g_proj": ("q_a_proj", "kv_a_proj_with_mqa", "g_proj"),
    },
    expert_re=EXPERT_RE,
    gate_up=GATE_UP,
    # mla.py: the MLA layer is the attention layer itself (neither Attention nor MLAAttention), and the
    # ModelOpt configs give a KV-cache method (which creates k_scale/v_scale) only to those classes.
    kv_scale_params=(),
    kv_note="vLLM's K3 MLA layer is neither Attention nor MLAAttention, so the ModelOpt config creates no "
            "k_scale/v_scale for it (nvidia/mla.py, modelopt.py get_quant_method)",
)

SGLANG_K3 = ModelServing(
    engine="sglang",
    model_type="kimi_k3",
    # kimi_k3.py hf_to_sglang_mapper, then load_weights strips "language_model." before the LM sees names.
    mapper=WeightsMapper(prefixes={"language_model.layers.": "language_model.model.layers."},
                         substrs={"block_sparse_moe": "mlp"}),
    strip_prefix="language_model.",
    fused=(
        # KimiK3DeltaAttention with use_full_rank_gate: fused_qkvg_proj [q, k, v, g] (MergedColumnParallelLinear).
        Fused("fused_qkvg_proj", ("q_proj", "k_proj", "v_proj", "g_proj")),
        # load_weights: q_a_proj / kv_a_proj_with_mqa rows of one ReplicatedLinear (deepseek_v2.py).
        Fused("fused_qkv_a_proj_with_mqa", ("q_a_proj", "kv_a_proj_with_mqa"), merged=False),
        Fused("gate_up_proj", ("gate_proj", "up_proj")),  # KimiK3MLP (dense MLP and shared experts)
    ),
    unquantized=(
        (r"\.routed_expert_(down|up)_proj$", "SGLang's K3 builds the latent-expert projections with "
                                             "quant_config=None for ModelOpt configs (kimi_k3.py KimiK3MoE: "
                                             "no supports_kimi_k3_quantized_latent_projections)"),
        (r"_res_proj$", "SGLang's K3 builds the attention-residual projections with quant_config=None"),
        (r"\.gate$", "SGLang's K3 router MoEGate is built with quant_config=None"),
        (r"^(vision_tower|mm_projector)\.", "SGLang's K3 vision tower and projector are built without a quant config"),
    ),
    formats_only=(
        (r"\.self_attn\.(f_a_proj|b_proj|f_b_proj)$", BLOCK_FP8,
         "SGLang's K3 KDA merges f_a/b(/f_b)_proj weights into one [f_a | b] GEMM operand, BF16 or block FP8 "
         "only (kimi_k3.py KimiK3DeltaAttention, _bfa_uses_block_fp8)"),
        (r"\.self_attn\.fused_qkv_a_proj_with_mqa$", BLOCK_FP8,
         "SGLang's K3 load_weights copies q_a_proj/kv_a_proj_with_mqa into fused_qkv_a_proj_with_mqa by rows "
         "(block scales by 128-row blocks); a per-tensor weight_scale_2/input_scale has no rows and one fused "
         "scalar cannot hold two"),
        (r"\.self_attn\.kv_b_proj$", BLOCK_FP8,
         "SGLang's K3 post_load_weights builds the absorbed w_kc/w_vc from kv_b_proj.weight, dequantizing only "
         "block FP8 (_get_k3_dense_weight)"),
    ),
    # KimiK3ForConditionalGeneration.packed_modules_mapping, merged with the config's own (the loader seeds
    # the quant config's mapping from the class; KimiK3LinearForCausalLM adds fused_qkvg_proj).
    packed_modules_mapping={
        "gate_up_proj": ("gate_proj", "up_proj"),
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "qkv_conv1d": ("q_conv1d", "k_conv1d", "v_conv1d"),
        "fused_qkvg_proj": ("q_proj", "k_proj", "v_proj", "g_proj"),
        "fused_qkvbfg_a_proj": ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj"),
        "fused_fg_b_proj": ("f_b_proj", "g_b_proj"),
    },
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


TRT_ATTN_RE = re.compile(r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.self_attn\.(?P<proj>\w+)$")
# The projections resolve_attention_quant_config is asked about (KimiLinearDecoderLayer / KimiMLARuntime).
TRT_KDA_RESOLVED = ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj")
TRT_MLA_RESOLVED = ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "g_proj", "o_proj")
TRT_FP8_BLOCK = 128  # FP8 KDA projections and MLA kv_b_proj: both dims multiples of 128
TRT_BANK_PREFIXES = ("language_model.model.", "model.")  # _K3_ROUTED_EXPERT_MODULE_PREFIXES


@dataclass(frozen=True)
class TrtQuant:
    """hf_quant_config.json as TensorRT-LLM's ModelConfig holds it (algos in QuantAlgo's spelling)."""

    algo: str | None
    exclude: ExcludeIndex
    per_layer: dict[str, str | None]
    # _build_modelopt_quant_config: each quantized_layers entry's own group_size (None when it has none), and the
    # top-level one (None defaulting to 128 for a single-format FP8_BLOCK_SCALES manifest).
    group_size: int | None = None
    per_layer_group: dict[str, int | None] = field(default_factory=dict)


def trt_quant_of(layout: Layout) -> TrtQuant:
    q = (layout.hf_quant or {}).get("quantization") or {}
    layers = next((cfg["quantized_layers"] for cfg in (q, layout.quant)
                   if isinstance(cfg, dict) and isinstance(cfg.get("quantized_layers"), dict)), {})
    return TrtQuant(trt_algo(q.get("quant_algo")), ExcludeIndex(q.get("exclude_modules") or ()),
                    {k: trt_algo(v) for k, v in _trt_per_layer_algos(layout).items()}, q.get("group_size"),
                    {k: v.get("group_size") for k, v in layers.items() if isinstance(v, dict)})


def trt_attention_algo(q: TrtQuant, layer: int, proj: str) -> str | None:
    """``resolve_attention_quant_config``: None (unquantized) or FP8_BLOCK_SCALES; anything else raises."""
    names = [f"{p}layers.{layer}.self_attn.{proj}" for p in TRT_KEY_PREFIXES]
    if any(trt_excluded_or_ancestor(n, q.exclude) for n in names):
        return None
    declared = [q.per_layer[n] for n in names if n in q.per_layer]
    if len(set(declared)) > 1:
        raise Refuse(names[0], f"quantized_layers gives the aliases of {names[0]} different algos "
                               f"({', '.join(sorted(map(str, set(declared))))}): TensorRT-LLM's "
                               "resolve_attention_quant_config raises 'Conflicting Kimi K3 quantization aliases'")
    algo = declared[0] if declared else (None if q.algo == "MIXED_PRECISION" else q.algo)
    if algo not in (None, FP8_BLOCK_SCALES):
        raise Refuse(names[0], f"attention projection declared {algo}: TensorRT-LLM's K3 resolve_attention_quant_"
                               "config accepts only unquantized or FP8_BLOCK_SCALES (ValueError)")
    if algo == FP8_BLOCK_SCALES:
        group = (q.per_layer_group.get(next(n for n in names if n in q.per_layer)) if declared
                 else TRT_FP8_BLOCK if q.group_size is None else q.group_size)
        if group not in (None, TRT_FP8_BLOCK):
            raise Refuse(names[0], f"attention projection declared FP8_BLOCK_SCALES with group_size {group}: "
                                   "TensorRT-LLM's K3 resolve_attention_quant_config requires 128x128 FP8 blocks "
                                   "(ValueError)")
    return algo


def _trt_attention(layout: Layout, q: TrtQuant) -> list[Refusal]:
    """The resolved attention projections: declared format stored, FP8 KDA all-or-none, 128 alignment."""
    layers: dict[int, dict[str, Linear]] = {}
    for name, linear in layout.linears.items():
        m = TRT_ATTN_RE.fullmatch(name)
        if m:
            layers.setdefault(int(m["layer"]), {})[m["proj"]] = linear
    out: list[Refusal] = []
    for layer, projs in sorted(layers.items()):
        kda = "q_proj" in projs
        resolved = [p for p in (TRT_KDA_RESOLVED if kda else TRT_MLA_RESOLVED) if p in projs]
        try:
            algos = {p: trt_attention_algo(q, layer, p) for p in resolved}
        except Refuse as r:
            out.append(Refusal(projs[r.refusal.tensor.rsplit(".", 1)[1]].tensor_name(), r.refusal.reason))
            continue
        if kda and len(set(algos.values())) > 1:
            fp8 = sorted(p for p, a in algos.items() if a)
            out.append(Refusal(projs["q_proj"].tensor_name(), f"KDA layer {layer}: FP8 declared for {', '.join(fp8)} "
                                                               "only; TensorRT-LLM's KimiKDALinearAttention takes "
                                                               "q/k/v/g/o as FP8 all together or none"))
            continue
        for proj, algo in algos.items():
            problem = _trt_attention_problem(projs[proj], algo, kda or proj == "kv_b_proj")
            if problem:
                out.append(Refusal(projs[proj].tensor_name(), problem))
    return out


def _trt_attention_problem(linear: Linear, algo: str | None, aligned: bool) -> str | None:
    want = FP8_PB_WO.engine_method if algo else "bf16"
    if linear.fmt != want:
        built = ("as FP8_BLOCK_SCALES (FP8 codes with 128x128 scales, read as stored)" if algo
                 else "unquantized (BF16; nothing in the configs quantizes it)")
        return (f"stored {linear.fmt}, but TensorRT-LLM's K3 resolve_attention_quant_config builds this projection "
                f"{built}")
    if algo and aligned and any(d % TRT_FP8_BLOCK for d in linear.shape):
        return (f"FP8 [{', '.join(map(str, linear.shape))}]: TensorRT-LLM's K3 FP8 KDA projections and MLA kv_b_proj "
                f"need both dims multiples of {TRT_FP8_BLOCK} (exact 128x128 block scales)")
    return None


def _trt_bank_excluded(q: TrtQuant, layer: int) -> bool:
    return any(trt_excluded_or_ancestor(f"{p}layers.{layer}.{s}", q.exclude)
               for p in TRT_BANK_PREFIXES for s in TRT_KEY_SUFFIXES)


def replay_trtllm(layout: Layout, *, numerics: bool = True) -> EngineResult:
    """TensorRT-LLM's K3 ``load_weights``: attention resolved per projection, the rest name-by-name into BF16
    trunk parameters and expert slots."""
    result = EngineResult("trtllm", warnings=config_json_group_size_warning(layout))
    per_layer = _trt_per_layer_algos(layout)
    q = trt_quant_of(layout)
    result.refusals += _trt_attention(layout, q)
    excluded_banks: set[str] = set()
    for _, linear in sorted(layout.linears.items()):
        m = TRT_EXPERT_RE.fullmatch(linear.name)
        if m and _trt_bank_excluded(q, int(m["layer"])):
            if m["module"] not in excluded_banks:
                excluded_banks.add(m["module"])
                result.refusals.append(Refusal(linear.tensor_name(), (
                    f"exclude_modules matches layer {m['layer']}'s routed-expert bank: TensorRT-LLM's K3 "
                    "_resolve_routed_quant_config checks exclusion before quantized_layers and returns no "
                    "quant_algo, for which _k3_expert_ckpt_spec raises NotImplementedError")))
            continue
        if m is None and _trt_resolved_attention(linear.name):
            continue
        problem = _trt_problem(linear, per_layer)
        if problem:
            result.refusals.append(Refusal(linear.tensor_name(), problem))
    if numerics and layout.read is not None:
        result.refusals += _trt_fc31_scales(layout, excluded_banks)
    result.refusals.sort(key=lambda r: r.tensor)
    if layout.kv_scales:
        result.deviations += kv_deviations(layout, dict.fromkeys(layout.kv_scales, TRT_KV_DROPPED), numerics)
    return result


def _trt_fc31_scales(layout: Layout, excluded_banks: set[str]) -> list[Refusal]:
    """NVFP4 routed experts go through the generic NVFP4 fused-MoE method's loader (``_K3_EXPERT_CKPT_SPECS``
    maps NVFP4 to it), which asserts each expert's w1 and w3 carry equal weight_scale_2 and input_scale
    (``trtllm.fc31_scales``): the first expert of each bank that breaks it."""
    banks: dict[str, dict[int, dict[str, Linear]]] = {}
    for name, linear in layout.linears.items():
        m = TRT_EXPERT_RE.fullmatch(name)
        if m and m["module"] not in excluded_banks and linear.fmt == NVFP4.engine_method:
            banks.setdefault(m["module"], {}).setdefault(int(m["expert"]), {})[m["proj"]] = linear
    out = []
    for _, per_expert in sorted(banks.items()):
        for _, projs in sorted(per_expert.items()):
            if all(p in projs for p in GATE_UP):
                refusal = fc31_scales(layout, projs[GATE_UP[0]], projs[GATE_UP[1]])
                if refusal:
                    out.append(refusal)
                    break
    return out


def _trt_resolved_attention(name: str) -> bool:
    m = TRT_ATTN_RE.fullmatch(name)
    return m is not None and m["proj"] in TRT_KDA_RESOLVED + TRT_MLA_RESOLVED


# The spec's ``ServingSpec.rules``: engine -> rules.
SERVING = {"vllm": VLLM_K3, "sglang": SGLANG_K3, "trtllm": replay_trtllm}
