"""vLLM's ModelOpt loading rules, replayed.

Written from vllm-project/vllm ``vllm/model_executor/layers/quantization/modelopt.py`` @ 00155cde
(``ModelOptQuantConfigBase.from_config`` / ``is_layer_excluded`` / ``apply_vllm_mapper``,
``ModelOptNvFp4LinearMethod``, ``ModelOptFp8LinearMethod``, ``ModelOptFp8PbWoLinearMethod``,
``ModelOptNvFp4FusedMoE``, ``ModelOptMixedPrecisionConfig._resolve_quant_algo``),
``vllm/model_executor/layers/quantization/utils/quant_utils.py::is_layer_skipped`` and
``vllm/model_executor/model_loader/weight_utils.py::{get_quant_config, maybe_remap_kv_scale_name}``.
The Kimi-K3 class itself (its fused parameters and what it builds unquantized) is in
``models/kimi_k3/serving.py``.
"""

from __future__ import annotations

import re
from fnmatch import fnmatch

import torch

from ...formats import FP8, FP8_PB_WO, NVFP4, W4A16_NVFP4, scheme_of_method
from ...numerics.constants import FP8_BLOCK
from ..layout import Layout, Linear
from .base import (
    ModelOptEngine,
    ModelServing,
    QuantView,
    Refuse,
    _expect,
    config_json_fields,
    modelopt_config,
)

# modelopt.py QUANT_ALGOS: any other quant_algo makes ModelOptQuantConfigBase.from_config raise.
QUANT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8", "MIXED_PRECISION")
# ModelOptMixedPrecisionConfig.get_quant_method: the per-layer algos it builds a method for; any other
# layer gets UnquantizedLinearMethod (Linear) or None (MoE).
MIXED_LINEAR_ALGOS = {s.algo: s.engine_method for s in (FP8, NVFP4, W4A16_NVFP4)}
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


def is_layer_skipped(prefix: str, ignored: list[str], fused: dict[str, tuple[str, ...]]) -> bool:
    """quant_utils.is_layer_skipped: a fused layer is skipped iff all its shards are listed exactly
    (some but not all raises); an experts layer iff some listed ``experts`` name contains it."""
    proj = prefix.split(".")[-1]
    if proj in fused:
        skipped = {prefix.replace(proj, shard) in ignored for shard in fused[proj]}
        if len(skipped) > 1:
            raise Refuse(prefix, f"vLLM: some but not all shards of {prefix} ({', '.join(fused[proj])}) are "
                                 "excluded; all shards of a fused layer need the same precision")
        return skipped.pop()
    if "experts" in prefix:
        return any(prefix in layer for layer in ignored if "experts" in layer)
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
            exclude=[serving.mapper(p) for p in _split_prefix_wildcards(exclude)],
            quantized_layers={serving.mapper(k): str(v.get("quant_algo", "")).upper() for k, v in layers.items()},
            kv_algo=kv,
            packed=serving.packed_modules_mapping or {},
            source=source,
        )

    def linear_excluded(self, qv: QuantView, prefix: str) -> bool:
        """ModelOptQuantConfigBase.is_layer_excluded: exact/fused match, substring, then fnmatch; vision
        towers are hard-coded unquantized after it (``get_quant_method``)."""
        if "vision_tower" in prefix:
            return True
        if not qv.exclude:
            return False
        if is_layer_skipped(prefix, qv.exclude, dict(qv.packed)):
            return True
        bare = prefix.removeprefix("language_model.") if prefix.startswith("language_model.") else None
        for pattern in qv.exclude:
            if pattern != prefix and (pattern in prefix or (bare is not None and pattern in bare)):
                return True
        return any(fnmatch(prefix, pattern) for pattern in qv.exclude)

    def experts_excluded(self, qv: QuantView, prefix: str) -> bool:
        return self.linear_excluded(qv, prefix)

    def remap_kv_scale(self, name: str, params: set[str]) -> tuple[str, bool]:
        if name in params:
            return name, True
        attn = "mla_attn.mla_attn" if any("mla_attn" in p for p in params) else "attn"
        for pattern, repl in KV_SCALE_PATTERNS:
            if re.search(pattern, name):
                target = re.sub(pattern, repl.format(attn=attn), name)
                return target, target in params
        return name, False

    def mixed_candidates(self, prefix: str) -> list[str]:
        # _quantized_layer_prefix_candidates
        return [prefix, "lm_head"] if prefix.endswith(".lm_head") else [prefix]

    def tensor_problem(self, method: str, piece: Linear) -> str | None:
        if scheme_of_method(method) is not FP8_PB_WO:
            return super().tensor_problem(method, piece)
        # ModelOptFp8PbWoLinearMethod.create_weights: 128-divisible dims, scale [out/128, 1, in/128, 1].
        out_f, in_f = piece.shape
        if out_f % FP8_BLOCK or in_f % FP8_BLOCK:
            return f"FP8_PB_WO needs out and in features divisible by {FP8_BLOCK}, got [{out_f}, {in_f}]"
        return _expect(piece, "weight", torch.float8_e4m3fn, (out_f, in_f)) or _expect(
            piece, "weight_scale", torch.float32, (out_f // FP8_BLOCK, 1, in_f // FP8_BLOCK, 1))


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

