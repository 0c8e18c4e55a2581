"""vLLM's ModelOpt loading rules, replayed.

Written from the vLLM 0.33.0 wheel on PyPI (``pip download --no-deps vllm==0.33.0``; one snapshot),
``vllm/model_executor/layers/quantization/modelopt.py``: ``LINEAR_ALGOS`` / ``QUANT_ALGOS``,
``ModelOptQuantConfigBase.{from_config, is_layer_excluded, get_quant_method, apply_vllm_mapper}``,
``ModelOptNvFp4Config._from_config`` (the fields NVFP4 requires), ``ModelOptMixedPrecisionConfig.
{_resolve_quant_algo, _quantized_layer_prefix_candidates, get_quant_method}`` (FP8, FP8_PB_WO, NVFP4,
W4A16_NVFP4, MXFP8 for Linears; the same for routed experts, FP8_PB_WO as block-FP8 ``Fp8MoEMethod``),
``KFp8Block128.create_weights`` (FP8_PB_WO: in divisible by 128, scale ``[ceil(out/128), 1, in/128, 1]``
fp32, a partial last output block padded by ``_Fp8PbWoPartialBlock``); ``utils/quant_utils.py::
is_layer_skipped``; ``model_loader/weight_utils.py::{get_quant_config, maybe_remap_kv_scale_name}``;
``transformers_utils/config.py::get_config`` (hf_quant_config.json when config.json has none) and
``transformers_utils/model_arch_config_convertor.py::ModelArchConfigConvertorBase._normalize_quantization_config``
(the ModelOpt quant_method only for producer.name "modelopt").
The Kimi-K3 class (``vllm/models/kimi_k3/nvidia/``, same wheel) is in ``models/kimi_k3/serving.py``.
"""

from __future__ import annotations

import re

import torch

from ...numerics.constants import FP8_BLOCK
from ...quant.schemes import FP8, FP8_PB_WO, NVFP4, W4A16_NVFP4, scheme_of_method
from ..layout import Layout, Linear
from ..report import GARBAGE
from .base import (
    ModelOptEngine,
    ModelServing,
    QuantView,
    Refuse,
    _expect,
    config_json_fields,
    modelopt_config,
)
from .excludes import ExcludeIndex

# modelopt.py QUANT_ALGOS (LINEAR_ALGOS + MIXED_PRECISION): any other quant_algo makes from_config raise.
QUANT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8", "MIXED_PRECISION")
# ModelOptMixedPrecisionConfig.get_quant_method: the per-layer algos (of this project's schemes) it builds a
# Linear / routed-experts method for (LINEAR_ALGOS; FP8_PB_WO experts as block-FP8 Fp8MoEMethod); any other
# layer gets UnquantizedLinearMethod (Linear) or None (MoE).
MIXED_LINEAR_ALGOS = {s.algo: s.engine_method for s in (FP8, FP8_PB_WO, NVFP4, W4A16_NVFP4)}
SINGLE_ALGOS = {s.algo: s.engine_method for s in (FP8, FP8_PB_WO, NVFP4, W4A16_NVFP4)}
# ModelOptFp8Config.FusedMoEMethodCls is the per-tensor ModelOptFp8MoEMethod whatever the FP8 algo.
SINGLE_EXPERT_ALGOS = {**SINGLE_ALGOS, FP8_PB_WO.algo: FP8.engine_method}
NVFP4_REQUIRED = ("group_size", "kv_cache_quant_algo", "exclude_modules")
# weight_utils.maybe_remap_kv_scale_name, in order (``{attn}`` is mla_attn.mla_attn when the model has one).
KV_SCALE_PATTERNS = (
    (r"\.self_attn\.([kv])_proj\.([kv])_scale$", r".self_attn.{attn}.\2_scale"),  # ModelOpt's names
    (r"\.self_attn\.qkv_proj\.([kv])_scale$", r".self_attn.attn.\1_scale"),
    (r"\.([qkv])_scale$", r".attn.\1_scale"),
)
# vLLM 0.33.0 models/utils.py AutoWeightsLoader.load_weights applies the quant config's get_cache_scale_mapper
# (layers/quantization/base_config.py QuantizationConfig.get_cache_scale_mapper; ModelOpt's configs keep the base
# one) to the weight stream *before* the model's own load_weights sees a name, so maybe_remap_kv_scale_name only
# ever gets the mapped name. The mapper's rules for the names a ModelOpt export has, in order (first match):
CACHE_SCALE_MAPPER = (
    (r"\.self_attn\.[kv]_proj\.([kv])_scale$", r".self_attn.attn.\1_scale"),
    (r"\.self_attn\.qk(?:qk)?v_proj\.([kv])_scale$", r".self_attn.attn.\1_scale"),
    (r"(?<!\.attn)\.([qkv])_scale$", r".attn.\1_scale"),
)


def _modelopt_method_named(cfg: dict, quant: dict, source: str) -> None:
    """transformers_utils/config.py ``get_config`` puts hf_quant_config.json (when config.json has no
    quantization_config) into ``hf_config.quantization_config``; ``model_arch_config_convertor.py``
    ``ModelArchConfigConvertorBase._normalize_quantization_config`` names its quant_method (modelopt,
    modelopt_fp4, modelopt_mixed) only when producer.name is exactly "modelopt" (or ``quantization`` holds a
    legacy ``modelopt_quant_config``). Otherwise quant_method stays "" and every ModelOpt
    ``override_quantization_method`` (``_extract_modelopt_quant_algo``: quant_method must start with
    "modelopt") declines: ``ModelConfig._verify_quantization`` leaves quantization None and the model is
    built unquantized, so load_weights meets scale tensors with no parameter (KeyError)."""
    producer = (cfg.get("producer") or {}).get("name")
    if producer == "modelopt" or "modelopt_quant_config" in quant:
        return
    if str(cfg.get("quant_method") or "").lower().startswith("modelopt"):
        return
    raise Refuse(source, f"producer.name is {producer!r}: vLLM names the ModelOpt quant_method of a "
                         "'quantization' config only for producer 'modelopt', so it builds the model unquantized "
                         "(load_weights then finds no parameter for the quantized tensors' scales)")


def is_layer_skipped(prefix: str, ignored: ExcludeIndex, fused: dict[str, tuple[str, ...]]) -> bool:
    """quant_utils.is_layer_skipped (match_mode "exact"): a fused layer is skipped when its own name is
    listed, else iff all its shards are listed exactly (some but not all raises); an experts layer iff
    some listed ``experts`` name contains it."""
    proj = prefix.split(".")[-1]
    if proj in fused and prefix in ignored:
        return True
    if proj in fused:
        skipped = {prefix.replace(proj, shard) in ignored for shard in fused[proj]}
        if len(skipped) > 1:
            raise Refuse(prefix, f"vLLM: some but not all shards of {prefix} ({', '.join(fused[proj])}) are "
                                 "excluded; all shards of a fused layer need the same precision")
        return skipped.pop()
    if "experts" in prefix:
        return ignored.inside_an_experts_entry(prefix)
    return prefix in ignored


class VllmEngine(ModelOptEngine):
    name = "vllm"
    mixed_methods = MIXED_LINEAR_ALGOS
    single_methods = SINGLE_ALGOS
    single_expert_methods = SINGLE_EXPERT_ALGOS

    def quant_view(self, layout: Layout, serving: ModelServing) -> QuantView:
        found = modelopt_config(layout)
        if found is None:
            raise Refuse("config.json", "no quantization_config and no hf_quant_config.json")
        cfg, source = found
        if "quantization" in cfg:  # the hf_quant_config.json layout
            quant = cfg["quantization"] if isinstance(cfg["quantization"], dict) else {}
            _modelopt_method_named(cfg, quant, source)
            algo = str(quant.get("quant_algo") or "").upper()
            kv = quant.get("kv_cache_quant_algo")
            exclude = quant.get("exclude_modules", [])
            layers = quant.get("quantized_layers", {})
            missing = [f for f in NVFP4_REQUIRED if f not in quant]
            if NVFP4.algo in algo and missing:  # the engine's substring test on the serialized name
                raise Refuse(source, f"vLLM's NVFP4 config requires {missing} in 'quantization'")
        else:
            algo, kv, exclude, layers = config_json_fields(cfg, source, "vLLM")
        if algo not in QUANT_ALGOS:
            raise Refuse(source, f"quant_algo {algo!r} is not one vLLM's ModelOpt config supports {list(QUANT_ALGOS)}")
        if algo == "MIXED_PRECISION" and not layers:
            raise Refuse(source, "MIXED_PRECISION needs a non-empty quantized_layers mapping")
        if not isinstance(exclude, list):
            raise Refuse(source, f"exclude_modules/ignore must be a list, got {type(exclude).__name__}")
        return QuantView(
            algo=algo,
            exclude=ExcludeIndex(serving.mapper(p) for p in _split_prefix_wildcards(exclude)),
            quantized_layers={serving.mapper(k): str(v.get("quant_algo", "")).upper() for k, v in layers.items()},
            kv_algo=kv,
            packed=serving.packed_modules_mapping or {},
            source=source,
        )

    def linear_excluded(self, qv: QuantView, prefix: str) -> bool:
        """ModelOptQuantConfigBase.is_layer_excluded: exact/fused match, substring, then fnmatch; vision
        towers are hard-coded unquantized after it (``get_quant_method``)."""
        if any(tower in prefix for tower in ("vision_tower", "vision_model", "vit_large_projector")):
            return True
        if not qv.exclude:
            return False
        if is_layer_skipped(prefix, qv.exclude, dict(qv.packed)):
            return True
        bare = prefix.removeprefix("language_model.") if prefix.startswith("language_model.") else None
        # An entry other than the prefix itself inside the prefix (or its language_model-less form), then fnmatch.
        if qv.exclude.has_substring_of(prefix, except_equal_to=prefix) or (
                bare is not None and qv.exclude.has_substring_of(bare, except_equal_to=prefix)):
            return True
        return qv.exclude.fnmatch_any(prefix)

    def experts_excluded(self, qv: QuantView, prefix: str) -> bool:
        return self.linear_excluded(qv, prefix)

    def remap_kv_scale(self, name: str, params: set[str]) -> tuple[str, bool]:
        if name in params:
            return name, True
        mapped = name
        for pattern, repl in CACHE_SCALE_MAPPER:  # AutoWeightsLoader's rename first (CACHE_SCALE_MAPPER)
            if re.search(pattern, name):
                mapped = re.sub(pattern, repl, name)
                break
        if mapped in params:
            return mapped, True
        target, exists = self._model_remap(mapped, params)
        if mapped != name and target != mapped:
            target = f"{mapped} (AutoWeightsLoader's cache-scale mapper) and then {target} (maybe_remap_kv_scale_name)"
        return target, exists

    @staticmethod
    def _model_remap(name: str, params: set[str]) -> tuple[str, bool]:
        """``weight_utils.maybe_remap_kv_scale_name`` (``KV_SCALE_PATTERNS``)."""
        if name in params:
            return name, True
        # Then the model's maybe_remap_kv_scale_name on the mapped name: a ModelOpt {k,v}_proj name no longer matches
        # its ModelOpt pattern, so an MLA model (DeepSeek-V3: scales on self_attn.mla_attn.mla_attn) gets the default
        # rule's self_attn.attn.attn.k_scale, no parameter: dropped (observed, tools/conformance cell
        # deepseek_v3-qformat-nvfp4-kv_fp8).
        attn = "mla_attn.mla_attn" if any("mla_attn" in p for p in params) else "attn"
        for pattern, repl in KV_SCALE_PATTERNS:
            if re.search(pattern, name):
                target = re.sub(pattern, repl.format(attn=attn), name)
                return target, target in params
        return name, False

    def mixed_candidates(self, prefix: str) -> list[str]:
        """ModelOptMixedPrecisionConfig._quantized_layer_prefix_candidates."""
        out = [prefix, "lm_head"] if prefix.endswith(".lm_head") else [prefix]
        for a, b in (("language_model.model.", "model.language_model."), ("model.language_model.", "language_model.model.")):
            if prefix.startswith(a):
                out.append(b + prefix[len(a):])
                break
        return out

    def mixed_algo(self, qv: QuantView, prefix: str) -> str | None:
        """_resolve_quant_algo after the direct, packed and child lookups: routed experts take the algo of
        any entry under their parent (``...block_sparse_moe.``, e.g. a quantized shared expert), and a
        fused ``qkv_proj``/``gate_up_proj`` the one algo of its listed shards."""
        algo = super().mixed_algo(qv, prefix)
        if algo is not None:
            return algo
        if prefix.endswith(".experts"):
            parent = prefix.rsplit(".experts", 1)[0] + "."
            return next((a for key, a in qv.quantized_layers.items() if key.startswith(parent)), None)
        base, _, proj = prefix.rpartition(".")
        shards = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(proj, ())
        algos = {qv.quantized_layers[f"{base}.{s}"] for s in shards if f"{base}.{s}" in qv.quantized_layers}
        if len(algos) > 1:
            raise Refuse(prefix, f"vllm: mixed quant_algo within fused layer {prefix}: {sorted(algos)}")
        return algos.pop() if algos else None

    def missing_input_scale(self, method: str, piece: Linear) -> Refuse:
        """``ModelOptNvFp4FusedMoE.create_weights`` makes ``w13_input_scale``/``w2_input_scale`` with
        ``torch.empty`` and ``load_weights`` writes only the names the checkpoint has; ``process_weights_after_
        loading`` then takes the max over experts of whatever memory held: no error, NaN or garbage served."""
        return Refuse(piece.tensor_name("input_scale"), (
            f"missing, while the config builds these routed experts {method} (W4A4): vLLM creates the expert "
            "input_scale parameters with torch.empty, nothing overwrites this one, and the layer's max over experts "
            "is uninitialised memory (an undeclared W4A16 bank: declare W4A16_NVFP4)"),
            verdict=GARBAGE, rule="input-scale-missing")

    def missing_fp8_scale(self, piece: Linear) -> Refuse:
        """``ModelOptFp8LinearMethod.create_weights`` fills ``weight_scale`` with ``finfo(float32).min``; the
        model's ``load_weights`` skips names without a parameter, so a scale under another prefix never lands."""
        return Refuse(piece.tensor_name("weight_scale"), (
            "missing (no tensor under this name; one under another prefix is skipped by load_weights): vLLM's FP8 "
            "method created it as finfo(float32).min and serves the weight with that scale, without an error"),
            verdict=GARBAGE, rule="fp8-weight-scale-missing")

    def tensor_problem(self, method: str, piece: Linear) -> str | None:
        if scheme_of_method(method) is not FP8_PB_WO:
            return super().tensor_problem(method, piece)
        # KFp8Block128.create_weights: in divisible by 128 (a partial last output block is padded at
        # load), scale [ceil(out/128), 1, in/128, 1] fp32.
        out_f, in_f = piece.shape
        if in_f % FP8_BLOCK:
            return f"FP8_PB_WO requires in divisible by {FP8_BLOCK}, got {in_f} (KFp8Block128.create_weights raises)"
        return _expect(piece, "weight", torch.float8_e4m3fn, (out_f, in_f)) or _expect(
            piece, "weight_scale", torch.float32, (-(-out_f // FP8_BLOCK), 1, in_f // FP8_BLOCK, 1))


def _split_prefix_wildcards(patterns: list[str]) -> list[str]:
    """apply_vllm_mapper: a ModelOpt ``module*`` pattern becomes ``module`` and ``module.*``."""
    out: list[str] = []
    for p in patterns:
        if len(p) >= 2 and p.endswith("*") and p[-2] != ".":
            out += [p[:-1], p[:-1] + ".*"]
        else:
            out.append(p)
    return out


VLLM = VllmEngine()

