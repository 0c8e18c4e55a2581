"""SGLang's ModelOpt loading rules, replayed.

Written from the SGLang 0.5.23 wheel on PyPI (``pip download --no-deps sglang==0.5.23``; one snapshot):
``sglang/srt/layers/quantization/modelopt_quant.py`` -- ``ModelOptQuantConfig.{_get_quant_method,
apply_weight_name_mapper, is_layer_excluded}``, ``ModelOptFp8Config`` (any quant_algo containing "FP8"),
``ModelOptFp4Config.from_config``, ``ModelOptMixedPrecisionConfig.{override_quantization_method (only
quant_method "modelopt_mixed"), from_config, _resolve_quant_algo, _quantized_layer_prefix_candidates,
get_quant_method}`` (FP8, FP8_PB_WO / FP8_BLOCK_SCALES as block FP8, MXFP8, NVFP4, W4A16_NVFP4 for Linears
and routed experts), ``ModelOptNvFp4FusedMoEMethod.apply`` (``situ`` only on the flashinfer_trtllm /
flashinfer_megamoe runner backends) --, ``layers/quantization/fp8.py`` ``Fp8LinearMethod.
validate_block_quant_shapes``, ``layers/quantization/utils.py`` ``is_layer_skipped`` / ``_module_path_match`` and
``model_loader/weight_utils.py`` (``get_quant_config``; ``maybe_remap_kv_scale_name``),
``configs/model_config.py`` ``ModelConfig.{_parse_quant_hf_config, _parse_modelopt_quant_config}`` (the
hf_quant_config.json fallback, any producer) and ``ModelOptNvFp4FusedMoEMethod.process_weights_after_loading``
with ``layers/moe/moe_runner/flashinfer_trtllm.py::align_fp4_moe_weights_for_flashinfer_trtllm`` (flashinfer's
shuffle: routed-expert GEMM rows % 128). The Kimi-K3 class is in
``models/kimi_k3/serving.py``.
"""

from __future__ import annotations

import math
import re

from ...numerics.constants import FP8_BLOCK
from ...quant.schemes import FP8, FP8_PB_WO, NVFP4, W4A16_NVFP4
from ..layout import Layout
from ..report import Deviation
from .base import (
    EngineModule,
    ModelOptEngine,
    ModelServing,
    QuantView,
    Refuse,
    config_json_fields,
    modelopt_config,
)
from .excludes import ExcludeIndex

# Fused shards SGLang's is_layer_skipped assumes when the config ships no packed_modules_mapping.
FALLBACK_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# modelopt.py is_layer_excluded: an exclude entry ending in one of these also excludes any module
# whose last name contains it (q_a_proj in fused_qkv_a_proj_with_mqa), in every layer.
FUSED_PATTERNS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
LINEAR_ALGOS = {s.algo: s.engine_method for s in (NVFP4, FP8)}
# ModelOptMixedPrecisionConfig.get_quant_method, of this project's schemes (Linear and FusedMoE alike).
MIXED_ALGOS = {s.algo: s.engine_method for s in (FP8, FP8_PB_WO, NVFP4, W4A16_NVFP4)}
# The runner backends whose ModelOpt NVFP4 MoE takes the situ activation (ModelOptNvFp4FusedMoEMethod.apply).
SITU_BACKEND = "flashinfer_trtllm"
SHUFFLE_ROWS = 128  # flashinfer's shuffle of the NVFP4 expert weights: rows (N) of w13 and w2 % 128
# Expert methods ModelOptNvFp4FusedMoEMethod serves (ModelOptFp4Config.get_quant_method, Moe=...).
NVFP4_EXPERT_METHODS = (NVFP4.engine_method, W4A16_NVFP4.engine_method)


def _hf_quant_config_method(quant: dict, source: str) -> None:
    """configs/model_config.py ``ModelConfig._parse_quant_hf_config`` -> ``_parse_modelopt_quant_config``:
    without ``quantization_config`` in config.json, SGLang names the method from hf_quant_config.json's
    quant_algo alone (any producer: weight_utils.get_quant_config's ``producer.name.startswith("modelopt")``
    branch and its fallback both call the method's ``from_config``). Other algos: no method, built BF16."""
    algo = quant.get("quant_algo")
    if algo == "MIXED_PRECISION":
        if not any(str((v or {}).get("quant_algo", "")).upper() in (NVFP4.algo, W4A16_NVFP4.algo)
                   for v in (quant.get("quantized_layers") or {}).values() if isinstance(v, dict)):
            raise Refuse(source, "MIXED_PRECISION without an NVFP4/W4A16_NVFP4 layer: SGLang's ModelConfig reads "
                                 "hf_quant_config.json as w4afp8, not as its ModelOpt mixed-precision config")
    elif not (algo and ("FP4" in algo or algo in (FP8.algo, "MXFP8"))):
        raise Refuse(source, f"quant_algo {algo!r} in hf_quant_config.json (config.json has no quantization_config): "
                             "SGLang's ModelConfig._parse_modelopt_quant_config names no method for it, so the model "
                             "is built unquantized")


def is_layer_skipped(prefix: str, ignored: ExcludeIndex, fused: dict[str, tuple[str, ...]]) -> bool:
    """utils.py is_layer_skipped: ``_module_path_match`` (an entry is the prefix, an ancestor, or a run of its
    dotted parts) of the prefix or, for a fused name, of each shard (some but not all raises)."""
    proj = prefix.split(".")[-1]
    mapping = fused if proj in fused else FALLBACK_FUSED
    if proj in mapping:
        skipped = {ignored.module_path_match(prefix.replace(proj, s)) for s in mapping[proj]}
        if len(skipped) > 1:
            raise Refuse(prefix, f"SGLang: some but not all shards of {prefix} ({', '.join(mapping[proj])}) are "
                                 "excluded; all shards of a fused layer need the same precision")
        return skipped.pop()
    skipped = ignored.module_path_match(prefix)
    if "experts" in prefix:
        skipped = skipped or ignored.inside_an_experts_entry(prefix)
    return skipped


class SglangEngine(ModelOptEngine):
    name = "sglang"
    mixed_methods = MIXED_ALGOS
    # ModelOptFp4Config for NVFP4; ModelOptFp8Config (per-tensor linear and MoE) for every FP8* algo.
    single_methods = single_expert_methods = {**LINEAR_ALGOS, W4A16_NVFP4.algo: W4A16_NVFP4.engine_method,
                                              FP8_PB_WO.algo: FP8.engine_method,
                                              "FP8_PER_CHANNEL_PER_TOKEN": FP8.engine_method}

    def quant_view(self, layout: Layout, serving: ModelServing) -> QuantView:
        found = modelopt_config(layout)
        if found is None:
            raise Refuse("config.json", "no quantization_config and no hf_quant_config.json")
        cfg, source = found
        if "quantization" in cfg:
            quant = cfg["quantization"] if isinstance(cfg["quantization"], dict) else {}
            if source == "hf_quant_config.json":
                _hf_quant_config_method(quant, source)
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
            if "quantization" not in cfg and cfg.get("quant_method") != "modelopt_mixed":
                raise Refuse(source, f"quant_algo MIXED_PRECISION with quant_method {cfg.get('quant_method')!r}: SGLang "
                                     "picks its mixed-precision config only for quant_method 'modelopt_mixed'")
        elif NVFP4.algo in algo:  # the engine's substring dispatch on the serialized name
            # ModelOptFp4Config.from_config: FP8, NVFP4, NVFP4_AWQ, W4A16_NVFP4; group_size (config.json: 16
            # by default for an NVFP4 name; hf_quant_config.json: common_group_size, required).
            if algo not in (NVFP4.algo, W4A16_NVFP4.algo, "NVFP4_AWQ"):
                raise Refuse(source, f"quant_algo {algo}: SGLang's ModelOpt FP4 config supports only FP8, NVFP4, "
                                     "NVFP4_AWQ and W4A16_NVFP4")
            if group_size is None and "quantization" in cfg:
                raise Refuse(source, "NVFP4 needs group_size (top level or in config_groups)")
        elif FP8.algo not in algo:
            raise Refuse(source, f"quant_algo {algo!r} is not one SGLang's ModelOpt configs read (FP8*, NVFP4, "
                                 "MIXED_PRECISION)")
        # apply_weight_name_mapper: the class's mapper, plus each name without "language_model.".
        mapped = [serving.mapper(p) for p in exclude]
        mapped += [p.removeprefix("language_model.") for p in mapped if p.startswith("language_model.")]
        return QuantView(
            algo=algo,
            exclude=ExcludeIndex(dict.fromkeys(mapped)),
            quantized_layers={serving.mapper(k): str(v.get("quant_algo", "")).upper() for k, v in layers.items()},
            kv_algo=kv,
            # the config's mapping, updated with the K3 class's (KimiK3LinearForCausalLM.__init__)
            packed={**(cfg.get("packed_modules_mapping") or {}), **(serving.packed_modules_mapping or {})},
            source=source,
        )

    def mixed_candidates(self, prefix: str) -> list[str]:
        """ModelOptMixedPrecisionConfig._quantized_layer_prefix_candidates (no candidate adds ``language_model.``
        back to a runtime ``model.`` name)."""
        out = [prefix, "lm_head"] if prefix.endswith(".lm_head") else [prefix]
        if prefix.startswith("language_model.model."):
            out.append("model.language_model." + prefix[len("language_model.model."):])
        elif prefix.startswith("model.language_model."):
            rest = prefix[len("model.language_model."):]
            out += ["language_model.model." + rest, "model." + rest]
        elif prefix.startswith("model."):
            out.append("model.language_model." + prefix[len("model."):])
        return out

    def tensor_problem(self, method, piece):
        if method != FP8_PB_WO.engine_method:
            return super().tensor_problem(method, piece)
        # Fp8LinearMethod (block) weight_scale_inv [ceil(out/128), ceil(in/128)]; the K3 loader takes the
        # checkpoint's 4-D [ceil(out/128), 1, ceil(in/128), 1] as [:, 0, :, 0].
        import torch

        from .base import _expect

        out_f, in_f = piece.shape
        blocks = (-(-out_f // FP8_BLOCK), 1, -(-in_f // FP8_BLOCK), 1)
        return _expect(piece, "weight", torch.float8_e4m3fn, (out_f, in_f)) or _expect(
            piece, "weight_scale", torch.float32, blocks)

    def module_problem(self, method: str, module: EngineModule, serving: ModelServing) -> str | None:
        """fp8.py validate_block_quant_shapes: a merged block-FP8 Linear needs every output partition divisible
        by 128 (at any TP size)."""
        if method != FP8_PB_WO.engine_method or not module.merged:
            return None
        bad = [f"{p.name.rpartition('.')[2]} ({p.shape[0]})" for p in module.pieces if p.shape[0] % FP8_BLOCK]
        if bad:
            return (f"SGLang builds {module.name} as block FP8 and Fp8LinearMethod.validate_block_quant_shapes "
                    f"refuses output partitions not divisible by {FP8_BLOCK}: {', '.join(bad)}")
        return None

    def serve_flags(self, layout: Layout, serving: ModelServing) -> list[str]:
        """NVFP4 routed experts with K3's situ activation: only the flashinfer_trtllm (or flashinfer_megamoe)
        runner backend runs them; the default ``auto`` passes loading and fails at the first forward."""
        if not self._situ_nvfp4_experts(layout, serving):
            return []
        flag = (f"--moe-runner-backend {SITU_BACKEND} (ModelOpt NVFP4 MoE takes the situ activation only on "
                "flashinfer_trtllm/flashinfer_megamoe; the default auto fails at the first forward)")
        return [flag]

    @staticmethod
    def _situ_nvfp4_experts(layout: Layout, serving: ModelServing) -> bool:
        text = layout.config.get("text_config") if isinstance(layout.config.get("text_config"), dict) else layout.config
        expert_re = re.compile(serving.expert_re)
        return text.get("hidden_act") == "situ" and any(
            lin.fmt in NVFP4_EXPERT_METHODS for name, lin in layout.linears.items() if expert_re.fullmatch(name))

    def moe_runner(self, layout: Layout, serving: ModelServing) -> str | None:
        """The MoE runner backend SGLang serves this export's routed experts with: the one ``serve_flags``
        asks for, else the class's config-time override of ``auto`` (``ModelServing.moe_runner``)."""
        if self._situ_nvfp4_experts(layout, serving):
            return SITU_BACKEND
        return serving.moe_runner(layout) if serving.moe_runner else None

    def experts_problem(self, method, per_expert, serving, layout):
        """With flashinfer_trtllm (the backend K3's situ experts need, ``serve_flags``, and the one SGLang's
        Qwen3-MoE override picks, ``ModelServing.moe_runner``),
        ``ModelOptNvFp4FusedMoEMethod.process_weights_after_loading`` (modelopt_quant.py; the MoE method of
        NVFP4 and W4A16_NVFP4 alike) runs ``moe_runner/flashinfer_trtllm.py::align_fp4_moe_weights_for_flashinfer_trtllm``,
        whose ``shuffle_matrix_sf_a`` asserts each GEMM's scale rows % 128 == 0 (flashinfer ``utils.py``
        ``get_shuffle_matrix_sf_a_row_indices``): GEMM1 has 2 x intermediate rows (``create_weights`` pads
        intermediate to 64, gated), GEMM2 has hidden rows, unpadded (``trtllm_nvfp4_hidden_alignment``: 1
        for a gated static-activation MoE)."""
        if method not in NVFP4_EXPERT_METHODS or self.moe_runner(layout, serving) != SITU_BACKEND:
            return None
        expert = next(iter(per_expert.values()))
        gate_up = [lin for proj, lin in expert.items() if proj in serving.gate_up]
        down = [lin for proj, lin in expert.items() if proj not in serving.gate_up]
        rows = {}
        if gate_up:
            rows["GEMM1 (w13)"] = 2 * -(-gate_up[0].shape[0] // 64) * 64
        if down:
            rows["GEMM2 (w2)"] = down[0].shape[0]
        short = {k: n for k, n in rows.items() if n % SHUFFLE_ROWS}
        if not short:
            return None
        return (f"SGLang's flashinfer_trtllm NVFP4 MoE post-processing (shuffle_matrix_sf_a) asserts routed-expert "
                f"GEMM rows % {SHUFFLE_ROWS} == 0; this export has "
                + ", ".join(f"{k} {n}" for k, n in short.items()) + " (AssertionError after load_weights)")

    def experts_deviations(self, method, module_name, per_expert, serving, layout):
        """W4A16_NVFP4 experts on flashinfer_trtllm: ``ModelOptFp4Config.from_config`` builds the same
        ``ModelOptNvFp4FusedMoEMethod`` (``use_per_token_activation`` False), whose ``create_weights`` fills
        ``w13_input_scale``/``w2_input_scale`` with 1.0 (``_make_per_tensor_scale_parameter(fill_value=1.0)``);
        a W4A16 export has no input_scale to overwrite them, and trtllm-gen has only the W4A4 NVFP4 MoE path
        (arg_groups/model_overrides/qwen3_moe.py), so the activations are quantized to NVFP4 with scale 1.0."""
        if method != W4A16_NVFP4.engine_method or self.moe_runner(layout, serving) != SITU_BACKEND:
            return []
        return [Deviation(module_name, "W4A16_NVFP4 routed experts on SGLang's flashinfer_trtllm runner: the "
                                       "activations are quantized to NVFP4 with the input-scale parameters' fill "
                                       "value 1.0 (the export has no input_scale; modelopt_quant.py "
                                       "ModelOptNvFp4FusedMoEMethod.create_weights)", math.inf)]

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
        if qv.exclude.regex_fullmatch_any([*prefixes, *(part for p in prefixes for part in p.split("."))]):
            return True
        return any(tail in last for tail in qv.exclude.tails.intersection(FUSED_PATTERNS))

    def linear_excluded(self, qv: QuantView, prefix: str) -> bool:
        # _get_quant_method, LinearBase: is_layer_skipped or is_layer_excluded -> UnquantizedLinearMethod.
        return is_layer_skipped(prefix, qv.exclude, dict(qv.packed)) or self.experts_excluded(qv, prefix)


SGLANG = SglangEngine()
