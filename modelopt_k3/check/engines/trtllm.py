"""TensorRT-LLM's generic handling of a ModelOpt checkpoint (PyTorch backend), for the per-model replays.

Read from NVIDIA/TensorRT-LLM's source as the code-search index holds it (several versions of each file, no
single commit; not run here -- where the versions disagree the rule refuses):

* ``tensorrt_llm/_torch/model_config.py`` ``ModelConfig.load_modelopt_quant_config``: reads ``hf_quant_config.json``'s ``quantization`` -- ``quant_algo``,
  ``kv_cache_quant_algo``, ``group_size``, ``exclude_modules``; ``MIXED_PRECISION`` reads per-layer algos
  from a ``quant_cfg.json`` in older builds and a normalized ``quantized_layers`` in newer ones (so this
  check does not settle MIXED_PRECISION and refuses it).
* ``tensorrt_llm/quantization/mode.py`` ``QuantAlgo``: NVFP4, FP8, FP8_BLOCK_SCALES, W4A16_MXFP4,
  W4A8_MXFP4_FP8, W4A8_MXFP4_MXFP8, MIXED_PRECISION, ... (no W4A16_NVFP4 in the versions read; newer
  tests name one, so it is refused as unsettled).
* ``tensorrt_llm/models/modeling_utils.py`` ``QuantConfig.is_module_excluded_from_quantization``:
  ``fnmatch.fnmatchcase`` of the engine module's own name against each ``exclude_modules`` entry;
  newer builds also try every ancestor name (so an ancestor-only match is unsettled and refused).
* ``tensorrt_llm/_torch/modules/linear.py`` ``NVFP4LinearMethod.load_weight_scales``: the pieces of
  a fused Linear (qkv_proj, gate_up_proj) must carry equal ``input_scale`` and equal ``weight_scale_2``
  (asserted, not maxed as vLLM/SGLang do).
* Newer builds (the Kimi-K3 loader's snapshot cited in ``models/kimi_k3/serving.py``) match an
  ``exclude_modules`` pattern against the module's name *and every ancestor* (``trt_excluded_or_ancestor``),
  and read ``quant_algo`` ``FP8_PB_WO`` as ``FP8_BLOCK_SCALES`` (``trt_algo``).
* ``tensorrt_llm/_torch/modules/fused_moe/quantization.py`` (NVFP4 fused-MoE method,
  ``load_expert_fc31_input_scale_nvfp4`` / ``load_expert_fc31_alpha_nvfp4``): per expert, w1 and w3
  must carry equal ``input_scale`` and equal ``weight_scale_2`` (asserted); the layer's GEMM input
  scale is the max over experts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fnmatch import fnmatchcase

from ...quant.schemes import FP8, FP8_PB_WO, NVFP4
from ..layout import Layout, Linear
from ..report import EngineResult, Refusal
from .base import Fused, Refuse, experts_scale_deviations
from .excludes import ExcludeIndex

# Single quant_algo values this check replays for TensorRT-LLM -> the Linear.fmt the method loads.
TRT_METHODS = {s.algo: s.engine_method for s in (NVFP4, FP8)}
HF_QUANT_CONFIG = "hf_quant_config.json"
FP8_BLOCK_SCALES = "FP8_BLOCK_SCALES"  # QuantAlgo.FP8_BLOCK_SCALES: 128x128 block FP8 weights


def trt_quant(layout: Layout) -> tuple[str | None, ExcludeIndex]:
    """(quant_algo upper-cased or None, exclude_modules) as ``load_modelopt_quant_config`` reads them."""
    q = (layout.hf_quant or {}).get("quantization")
    if not isinstance(q, dict):
        if layout.quant:
            raise Refuse("config.json", "no hf_quant_config.json: this check replays only TensorRT-LLM's "
                                        "hf_quant_config.json reading (ModelConfig.load_modelopt_quant_config)")
        return None, ExcludeIndex(())
    algo = str(q.get("quant_algo") or "").upper() or None
    if algo == "MIXED_PRECISION":
        raise Refuse(HF_QUANT_CONFIG, "quant_algo MIXED_PRECISION: TensorRT-LLM's per-layer source differs by "
                                      "version (quant_cfg.json vs quantized_layers); this check does not settle it")
    if algo is not None and algo not in TRT_METHODS:
        raise Refuse(HF_QUANT_CONFIG, f"quant_algo {algo}: not one this check replays for TensorRT-LLM "
                                      f"({sorted(TRT_METHODS)}; W4A16_NVFP4 is absent from QuantAlgo in the "
                                      "versions read)")
    return algo, ExcludeIndex(q.get("exclude_modules") or ())


def trt_excluded(name: str, exclude: ExcludeIndex) -> bool:
    """``is_module_excluded_from_quantization`` on the module's own name; an ancestor-only match is refused."""
    if exclude.fnmatch_any(name, case=True):
        return True
    parts = name.split(".")
    for i in range(1, len(parts)):
        ancestor = ".".join(parts[:i])
        hit = exclude.first_fnmatchcase(ancestor)
        if hit:
            raise Refuse(name, f"only its ancestor {ancestor} matches exclude entry {hit!r}: older TensorRT-LLM "
                               "builds match the module's own name only, newer ones also ancestors; unsettled")
    return False


def trt_excluded_or_ancestor(name: str, exclude: ExcludeIndex) -> bool:
    """``QuantConfig.is_module_excluded_from_quantization`` as the newest builds run it (replayed by
    ``tools/conformance/trtllm.py``): the name or any ancestor matches an entry by ``fnmatchcase``, a ``re:``
    entry by ``re.fullmatch``, or an ``x.*`` entry by being ``x`` itself (the subtree's root)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if (exclude.fnmatch_any(candidate, case=True) or any(r.fullmatch(candidate) for r in exclude.full_regexes)
                or any(fnmatchcase(candidate, root) for root in exclude.subtree_parents)):
            return True
    return False


def trt_algo(algo: str | None) -> str | None:
    """A ModelOpt quant_algo as TensorRT-LLM's QuantAlgo names it (FP8_PB_WO is its FP8_BLOCK_SCALES)."""
    algo = str(algo).upper() if algo else None
    return FP8_BLOCK_SCALES if algo == FP8_PB_WO.algo else algo


def config_json_group_size_warning(layout: Layout) -> list[str]:
    """TensorRT-LLM's ``warn_if_inline_diverges`` (``tensorrt_llm/quantization/modelopt_config.py``, replayed by
    ``tools/conformance/trtllm.py``): with hf_quant_config.json present, a ModelOpt ``quantization_config`` in
    config.json whose ``group_size`` differs from the file's is warned about, and the file's is used. Equal (both
    absent included): no warning."""
    inline = layout.quant
    if not isinstance(inline, dict) or layout.hf_quant is None or not (
            str(inline.get("quant_method", "")).lower().startswith("modelopt")
            or (inline.get("producer") or {}).get("name") == "modelopt"):
        return []
    inline = inline["quantization"] if isinstance(inline.get("quantization"), dict) else inline
    file_group = (layout.hf_quant.get("quantization") or {}).get("group_size")
    group = inline.get("group_size")
    if group == file_group:
        return []
    said = "has no group_size" if group is None else f"has group_size {group}"
    return [f"config.json: quantization_config {said}, hf_quant_config.json {file_group} (TensorRT-LLM warns and "
            "reads hf_quant_config.json's)"]


def trt_method(algo: str | None, excluded: bool) -> str:
    return "bf16" if algo is None or excluded else TRT_METHODS[algo]


def format_refusal(piece: Linear, method: str, where: str, why: str) -> Refusal | None:
    if piece.fmt == method:
        return None
    return Refusal(piece.tensor_name(), f"stored {piece.fmt}, but TensorRT-LLM builds {where} as {method} ({why})")


def equal_scales(layout: Layout, pieces: list[Linear], keys: tuple[str, ...], rule: str,
                 rule_name: str = "") -> Refusal | None:
    """TensorRT-LLM asserts equality of these per-tensor scales across ``pieces`` (``rule`` names where;
    ``rule_name``: the serving rule, when it has a name)."""
    for key in keys:
        values = [float(layout.value(p.tensor_name(key))) for p in pieces]
        if len(set(values)) > 1:
            names = ", ".join(p.name.rpartition(".")[2] for p in pieces)
            return Refusal(pieces[0].tensor_name(key), f"{key} differ across {names} ({min(values):.6g}.."
                                                       f"{max(values):.6g}); {rule} asserts they are equal",
                           rule=rule_name)
    return None


# The NVFP4 fused-MoE loader's assertions on each expert's w1/w3 (serving rule trtllm-fc31-scales).
FC31_RULE = ("the NVFP4 fused-MoE loader (fused_moe/quantization.py load_expert_fc31_alpha_nvfp4 / "
             "load_expert_fc31_input_scale_nvfp4)")
FC31_RULE_NAME = "trtllm-fc31-scales"


def fc31_scales(layout: Layout, w1: Linear, w3: Linear) -> Refusal | None:
    """One expert's w1/w3 as TensorRT-LLM's NVFP4 fused-MoE loader takes them: equal ``weight_scale_2`` and
    ``input_scale`` (``torch.allclose`` asserted; builds that take the max instead serve one half mis-scaled)."""
    return equal_scales(layout, [w1, w3], NVFP4_SCALES, FC31_RULE, FC31_RULE_NAME)


# ---------------------------------------------------------------------- a model class with VANILLA routed experts
# (Qwen3-MoE's and DeepSeek-V3's TensorRT-LLM classes): per-expert w1/w2/w3, fused Linears, one rule per module.

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # w1, w3, w2: every one of every expert is read
NVFP4_SCALES = ("weight_scale_2", "input_scale")  # the per-tensor scales a fused NVFP4 group must share
ModuleRule = Callable[[Layout, str, list[Linear], "str | None", ExcludeIndex, bool], "Refusal | None"]


def trt_why(algo: str | None, method: str, name: str) -> str:
    """Why TensorRT-LLM builds ``name`` as ``method``: the declared quant_algo and whether exclude_modules matches."""
    if algo is None:
        return "hf_quant_config.json declares no quant_algo"
    return f"quant_algo {algo}; exclude_modules {'matches' if method == 'bf16' else 'does not match'} {name}"


def trt_groups(layout: Layout, expert_re: str, fused: tuple[Fused, ...]
               ) -> tuple[dict[str, list[Linear]], dict[str, dict[int, dict[str, Linear]]]]:
    """Engine modules (each of ``fused`` under its engine name, its pieces in shard order; else one Linear each)
    and routed experts (module -> expert -> projection, by ``expert_re``'s groups)."""
    engine_name = {piece: f.engine_name for f in fused for piece in f.pieces}
    order = {piece: i for f in fused for i, piece in enumerate(f.pieces)}
    experts_re = re.compile(expert_re)
    modules: dict[str, list[Linear]] = {}
    experts: dict[str, dict[int, dict[str, Linear]]] = {}
    for name, linear in sorted(layout.linears.items()):
        m = experts_re.fullmatch(name)
        if m:
            experts.setdefault(m["module"], {}).setdefault(int(m["expert"]), {})[m["proj"]] = linear
            continue
        parent, _, last = name.rpartition(".")
        modules.setdefault(f"{parent}.{engine_name[last]}" if last in engine_name else name, []).append(linear)
    for pieces in modules.values():
        pieces.sort(key=lambda lin: order.get(lin.name.rpartition(".")[2], 0))
    return modules, experts


def trt_vanilla_experts(layout: Layout, module: str, per_expert: dict[int, dict[str, Linear]], algo: str | None,
                        exclude: ExcludeIndex, numerics: bool, gate_up: tuple[str, str]) -> Refusal | None:
    """VANILLA expert loading: every expert's w1, w2 and w3 in the method the bank is built with, and (NVFP4) each
    expert's gate/up sharing their per-tensor scales."""
    method = trt_method(algo, trt_excluded(module, exclude))
    why = trt_why(algo, method, module)
    for e, projs in sorted(per_expert.items()):
        for proj in EXPERT_PROJECTIONS:
            if proj not in projs:
                return Refusal(f"{module}.{e}.{proj}.weight", "missing: TensorRT-LLM's VANILLA expert loading "
                                                             "reads w1, w2 and w3 of every expert")
            refusal = format_refusal(projs[proj], method, f"the routed experts {module}", why)
            if refusal:
                return refusal
        if method == NVFP4.engine_method and numerics and layout.read is not None:
            refusal = fc31_scales(layout, projs[gate_up[0]], projs[gate_up[1]])
            if refusal:
                return refusal
    return None


def replay_vanilla_experts_model(layout: Layout, result: EngineResult, module_rule: ModuleRule, *, expert_re: str,
                                 fused: tuple[Fused, ...], gate_up: tuple[str, str], numerics: bool) -> bool:
    """Add to ``result`` what TensorRT-LLM's loading of ``layout`` refuses or reads differently: ``module_rule``
    for each engine module (``trt_groups``), ``trt_vanilla_experts`` for each routed experts bank, and an NVFP4
    bank's one fc31/fc2 input scale per layer (the max over experts, fused_moe/quantization.py). False: the quant
    config itself is refused (nothing else is looked at)."""
    try:
        algo, exclude = trt_quant(layout)
    except Refuse as r:
        result.refusals.append(r.refusal)
        return False
    modules, experts = trt_groups(layout, expert_re, fused)
    for name, pieces in modules.items():
        try:
            refusal = module_rule(layout, name, pieces, algo, exclude, numerics)
        except Refuse as r:
            refusal = r.refusal
        if refusal:
            result.refusals.append(refusal)
    for module, per_expert in experts.items():
        try:
            refusal = trt_vanilla_experts(layout, module, per_expert, algo, exclude, numerics, gate_up)
        except Refuse as r:
            refusal = r.refusal
        if refusal:
            result.refusals.append(refusal)
        elif numerics and layout.read is not None and \
                next(iter(per_expert[min(per_expert)].values())).fmt == NVFP4.engine_method:
            result.deviations += experts_scale_deviations(layout, module, per_expert, gate_up, NVFP4.engine_method)
    return True
