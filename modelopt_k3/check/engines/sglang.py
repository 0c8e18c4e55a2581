"""SGLang's ModelOpt loading rules, replayed.

Written from sgl-project/sglang ``python/sglang/srt/layers/quantization/modelopt/`` --
``modelopt.py`` @ 3d2509d8 (``ModelOptQuantConfig._get_quant_method``, ``is_layer_excluded``,
``apply_weight_name_mapper``), ``schemes/modelopt_fp4.py`` @ 09bd8898 (``ModelOptFp4Config.from_config``,
``ModelOptFp4LinearMethod``, ``ModelOptNvFp4FusedMoEMethod``), ``schemes/modelopt_fp8.py`` @ 578ca2f6
(``ModelOptFp8Config``: any quant_algo containing "FP8" is per-tensor FP8), ``schemes/
modelopt_mixed_precision.py`` @ 717e1203 (``_resolve_quant_algo``: FP8 and NVFP4 only) --,
``python/sglang/srt/layers/quantization/utils`` ``is_layer_skipped`` / ``_module_path_match`` (read
from a mirror; commit not pinned) and ``python/sglang/srt/model_loader/weight_utils.py``
@ 00b08c49 (``get_quant_config``: the hf_quant_config.json fallback requires
``producer.name == "modelopt"``; ``maybe_remap_kv_scale_name``). The Kimi-K3 class is in
``models/kimi_k3/serving.py``.
"""

from __future__ import annotations

import re

from ...formats import FP8, FP8_PB_WO, NVFP4
from ..layout import Layout
from .base import ModelOptEngine, ModelServing, QuantView, Refuse, config_json_fields, modelopt_config

# Fused shards SGLang's is_layer_skipped assumes when the config ships no packed_modules_mapping.
FALLBACK_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# modelopt.py is_layer_excluded: an exclude entry ending in one of these also excludes any module
# whose last name contains it (q_a_proj in fused_qkv_a_proj_with_mqa), in every layer.
FUSED_PATTERNS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
LINEAR_ALGOS = {s.algo: s.engine_method for s in (NVFP4, FP8)}


def _module_path_match(ignored: str, prefix: str) -> bool:
    ignored, prefix = ignored.rstrip("."), prefix.rstrip(".")
    return ignored == prefix or prefix.startswith(ignored + ".") or f".{ignored}." in f".{prefix}."


def is_layer_skipped(prefix: str, ignored: list[str], fused: dict[str, tuple[str, ...]]) -> bool:
    proj = prefix.split(".")[-1]
    mapping = fused if proj in fused else FALLBACK_FUSED
    if proj in mapping:
        skipped = {any(_module_path_match(i, prefix.replace(proj, s)) for i in ignored) for s in mapping[proj]}
        if len(skipped) > 1:
            raise Refuse(prefix, f"SGLang: some but not all shards of {prefix} ({', '.join(mapping[proj])}) are "
                                 "excluded; all shards of a fused layer need the same precision")
        return skipped.pop()
    skipped = any(_module_path_match(i, prefix) for i in ignored)
    if "experts" in prefix:
        skipped = skipped or any(prefix in layer for layer in ignored if "experts" in layer)
    return skipped


class SglangEngine(ModelOptEngine):
    name = "sglang"
    mixed_methods = LINEAR_ALGOS  # ModelOptMixedPrecisionConfig.get_quant_method: FP8 and NVFP4 only
    # ModelOptFp4Config for NVFP4; ModelOptFp8Config (per-tensor linear and MoE) for every FP8* algo.
    single_methods = single_expert_methods = {**LINEAR_ALGOS, FP8_PB_WO.algo: FP8.engine_method,
                                              "FP8_PER_CHANNEL_PER_TOKEN": FP8.engine_method}

    def quant_view(self, layout: Layout, serving: ModelServing) -> QuantView:
        found = modelopt_config(layout)
        if found is None:
            raise Refuse("config.json", "no quantization_config and no hf_quant_config.json")
        cfg, source = found
        if "quantization" in cfg:
            producer = (cfg.get("producer") or {}).get("name")
            if producer != "modelopt":  # weight_utils.get_quant_config, modelopt branch
                raise Refuse(source, f"SGLang reads hf_quant_config.json only when producer.name is 'modelopt'; "
                                     f"it is {producer!r}")
            quant = cfg["quantization"] if isinstance(cfg["quantization"], dict) else {}
            algo = str(quant.get("quant_algo") or "").upper()
            kv = quant.get("kv_cache_quant_algo")
            exclude = quant.get("exclude_modules") or []
            layers = quant.get("quantized_layers", {})
            group_size = quant.get("group_size")
        else:
            algo, kv, exclude, layers = config_json_fields(cfg, source, "SGLang")
            group_size = cfg.get("group_size") or next(
                iter((g.get("weights") or {}).get("group_size") for g in (cfg.get("config_groups") or {}).values()), None)
        if algo == "MIXED_PRECISION":
            if not layers:
                raise Refuse(source, "MIXED_PRECISION needs a non-empty quantized_layers map")
        elif NVFP4.algo in algo:  # the engine's substring dispatch on the serialized name
            if algo != NVFP4.algo:  # ModelOptFp4Config.from_config: quant_algo must be FP8 or NVFP4
                raise Refuse(source, f"quant_algo {algo}: SGLang's ModelOpt FP4 config supports only FP8 and NVFP4")
            if group_size is None:
                raise Refuse(source, "NVFP4 needs group_size (top level or in config_groups)")
        elif FP8.algo not in algo:
            raise Refuse(source, f"quant_algo {algo!r} is not one SGLang's ModelOpt configs read (FP8*, NVFP4, "
                                 "MIXED_PRECISION)")
        # apply_weight_name_mapper: the class's mapper, plus each name without "language_model.".
        mapped = [serving.mapper(p) for p in exclude]
        mapped += [p.removeprefix("language_model.") for p in mapped if p.startswith("language_model.")]
        return QuantView(
            algo=algo,
            exclude=list(dict.fromkeys(mapped)),
            quantized_layers={serving.mapper(k): str(v.get("quant_algo", "")).upper() for k, v in layers.items()},
            kv_algo=kv,
            packed=cfg.get("packed_modules_mapping") or {},
            source=source,
        )

    def remap_kv_scale(self, name: str, params: set[str]) -> tuple[str, bool]:
        """weight_utils.maybe_remap_kv_scale_name: ...self_attn.{k,v}_proj.{k,v}_scale (ModelOpt) and any
        other ...{k,v}_scale both go to ...attn.{k,v}_scale."""
        for suffix in (".k_scale", ".v_scale"):
            if name.endswith(suffix):
                modelopt = f".self_attn.{suffix[1]}_proj{suffix}"
                target = (name.replace(modelopt, f".self_attn.attn{suffix}") if modelopt in name
                          else name.replace(suffix, f".attn{suffix}"))
                return target, target in params
        return name, name in params

    def experts_excluded(self, qv: QuantView, prefix: str) -> bool:
        """modelopt.py is_layer_excluded (all that ``_get_quant_method`` consults for FusedMoE): glob over
        the whole name or one dotted part, the ``language_model.``-less variant, and the MLA fused-name
        patterns."""
        prefixes = [prefix] + ([prefix.removeprefix("language_model.")] if prefix.startswith("language_model.") else [])
        last = prefix.rsplit(".", 1)[-1]
        for pattern in qv.exclude:
            regex = pattern.replace(".", r"\.").replace("*", ".*")
            for p in prefixes:
                if re.fullmatch(regex, p) or any(re.fullmatch(regex, part) for part in p.split(".")):
                    return True
            tail = pattern.rsplit(".", 1)[-1]
            if tail in FUSED_PATTERNS and tail in last:
                return True
        return False

    def linear_excluded(self, qv: QuantView, prefix: str) -> bool:
        # _get_quant_method, LinearBase: is_layer_skipped or is_layer_excluded -> UnquantizedLinearMethod.
        return is_layer_skipped(prefix, qv.exclude, dict(qv.packed)) or self.experts_excluded(qv, prefix)


SGLANG = SglangEngine()
