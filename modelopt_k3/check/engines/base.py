"""The replay shared by engines that read ``quant_method: "modelopt"`` checkpoints (vLLM, SGLang).

What differs between engines is data or a small hook: how the engine's quant config parses the
checkpoint's configs and resolves one module's method (``ModelOptEngine`` subclasses, written
from each engine's ``modelopt`` quantization code), and how the engine's class for one model type
fuses and names that model's Linears (a ``ModelServing``, declared next to the model in
``models/<model>/serving.py``). The replay itself -- fused groups, per-piece formats, tensor
shapes, scale use -- is one function for all of them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ...numerics import fp8 as fp8n
from ...quant.schemes import FP8, KV_FP8, NVFP4, W4A16_NVFP4, scheme_of_method
from ..layout import Layout, Linear
from ..report import GARBAGE, REFUSES, Deviation, EngineResult, Refusal
from .excludes import ExcludeIndex


class Refuse(Exception):
    """Raised inside a replay step: the engine stops at ``tensor`` for ``reason``."""

    def __init__(self, tensor: str, reason: str, *, verdict: str = REFUSES, rule: str = "") -> None:
        super().__init__(reason)
        self.refusal = Refusal(tensor, reason, verdict=verdict, rule=rule)


@dataclass(frozen=True)
class WeightsMapper:
    """An engine class's checkpoint-name rewrite (vLLM/SGLang ``WeightsMapper``), also applied by the
    engines to the quant config's module lists."""

    prefixes: Mapping[str, str] = field(default_factory=dict)
    substrs: Mapping[str, str] = field(default_factory=dict)

    def __call__(self, name: str) -> str:
        for old, new in self.prefixes.items():
            if name.startswith(old):
                name = new + name[len(old):]
                break
        for old, new in self.substrs.items():
            name = name.replace(old, new)
        return name


@dataclass(frozen=True)
class Fused:
    """One engine parameter holding several checkpoint Linears of the same parent module."""

    engine_name: str  # e.g. "in_proj_qkvgfab"
    pieces: tuple[str, ...]  # checkpoint last names in shard order, e.g. ("q_proj", "k_proj", ...)
    merged: bool = True  # a merged Linear with one output partition per piece (False: one replicated Linear)


@dataclass(frozen=True)
class ModelServing:
    """How one engine's class for one model type loads that model's checkpoint (data, cited there)."""

    engine: str
    model_type: str
    mapper: WeightsMapper
    strip_prefix: str  # dropped before the language model sees names (SGLang's Kimi-K3: "language_model.")
    fused: tuple[Fused, ...]
    # (regex searched in the checkpoint module name, reason): modules the engine's class builds without
    # a quant config -- always unquantized, whatever the checkpoint's configs say.
    unquantized: tuple[tuple[str, str], ...]
    # (regex, stored formats the class can read there besides BF16, reason): modules built with the quant
    # config whose weight the class also reads directly (or copies by rows), so only those formats work.
    formats_only: tuple[tuple[str, tuple[str, ...], str], ...]
    # fused engine name -> checkpoint piece names, as the engine's quant config sees it (exclusions,
    # per-layer algos); None: taken from the checkpoint's quantization_config (SGLang).
    packed_modules_mapping: Mapping[str, tuple[str, ...]] | None
    expert_re: str  # fullmatch on routed-expert Linear names, groups: module, expert, proj
    gate_up: tuple[str, str]  # the expert projections fused into w13, in order (w1, w3)
    # KV-cache scale parameters the class has under an attention module (engine names, relative to
    # the checkpoint's ``...self_attn`` module), and why there are no others (for messages).
    kv_scale_params: tuple[str, ...]
    kv_note: str
    # (regex searched in the engine module name, reason): checkpoint modules the class has no parameter for;
    # its load_weights skips their tensors without an error and what the class built there stays unwritten.
    ignored: tuple[tuple[str, str], ...] = ()
    # The MoE runner backend the engine's config-time override picks for this class under the default
    # ``auto`` (None: the engine's generic default), from the checkpoint's configs.
    moe_runner: Callable[[Layout], str | None] | None = None
    # The class's own rename of a checkpoint KV-scale name (engine naming) before it looks the name up,
    # used instead of the engine's ``maybe_remap_kv_scale_name`` (None: the engine's remap).
    kv_scale_rename: Callable[[str], str] | None = None

    def engine_prefix(self, name: str) -> str:
        return self.mapper(name).removeprefix(self.strip_prefix)

    def unquantized_reason(self, name: str) -> str | None:
        return _first_match(self.unquantized, name)

    def ignored_reason(self, name: str) -> str | None:
        return _first_match(self.ignored, name)

    def format_reason(self, name: str, fmt: str) -> str | None:
        """Why ``fmt`` cannot be stored at module ``name`` (None: it can)."""
        for pattern, allowed, reason in self.formats_only:
            if re.search(pattern, name) and fmt != "bf16" and fmt not in allowed:
                return reason
        return None


def _first_match(rules: tuple[tuple[str, str], ...], name: str) -> str | None:
    for pattern, reason in rules:
        if re.search(pattern, name):
            return reason
    return None


@dataclass
class QuantView:
    """The engine's parsed ModelOpt quant config."""

    algo: str  # upper-case quant_algo
    exclude: ExcludeIndex  # after the engine's own name mapping, indexed once (linear in the list's size)
    quantized_layers: dict[str, str]  # module -> upper-case quant_algo (MIXED_PRECISION), mapped
    kv_algo: str | None
    packed: Mapping[str, tuple[str, ...]]
    source: str  # which file it came from


@dataclass(frozen=True)
class EngineModule:
    """One Linear-like module of the engine: a fused parameter or a single checkpoint Linear."""

    name: str  # checkpoint-side name: parent + engine name
    pieces: tuple[Linear, ...]
    merged: bool = False  # one output partition per piece (a merged Linear of several pieces)


class ModelOptEngine:
    """Generic rules of one engine's ModelOpt quantization code; subclasses fill the hooks.

    Method resolution follows both engines' ``get_quant_method``: an excluded module is built
    unquantized; under MIXED_PRECISION the module's algo comes from ``quantized_layers`` (its own
    name, its fused shards, then any child) and only ``mixed_methods`` are dispatched -- anything
    else is built unquantized; otherwise the config's one algo decides.
    """

    name = "engine"
    # MIXED_PRECISION per-layer algos the engine builds a method for -> Linear.fmt
    mixed_methods: Mapping[str, str] = {}
    # single quant_algo -> Linear.fmt of dense layers / of routed experts
    single_methods: Mapping[str, str] = {}
    single_expert_methods: Mapping[str, str] = {}

    def quant_view(self, layout: Layout, serving: ModelServing) -> QuantView:
        raise NotImplementedError

    def linear_excluded(self, qv: QuantView, prefix: str) -> bool:
        raise NotImplementedError

    def experts_excluded(self, qv: QuantView, prefix: str) -> bool:
        raise NotImplementedError

    def mixed_candidates(self, prefix: str) -> list[str]:
        """Names under which ``quantized_layers`` may list ``prefix`` itself."""
        return [prefix]

    def tensor_problem(self, method: str, piece: Linear) -> str | None:
        """Why ``piece``'s tensors do not fit the parameters ``method`` creates (None: they fit)."""
        return standard_tensor_problem(method, piece)

    def missing_input_scale(self, method: str, piece: Linear) -> Refuse:
        """A routed expert stored NVFP4 without ``input_scale`` where the engine builds NVFP4 W4A4 (an undeclared
        W4A16 bank, or scales dropped): what the engine then does (default: it stops at that tensor)."""
        return Refuse(piece.tensor_name("input_scale"), f"missing: {self.name} builds the routed experts as "
                                                        f"{method}, whose method expects an input_scale per expert")

    def missing_fp8_scale(self, piece: Linear) -> Refuse:
        """An FP8 weight whose ``weight_scale`` is not under its name (a wrong prefix, dropped): what the engine
        then does (default: it stops at that tensor)."""
        return Refuse(piece.tensor_name("weight_scale"), f"missing: {self.name}'s FP8 method expects it")

    def module_problem(self, method: str, module: EngineModule, serving: ModelServing) -> str | None:
        """Why the engine's one (possibly fused) module refuses ``method`` as a whole (None: it does not)."""
        return None

    def experts_problem(self, method: str, per_expert: dict[int, dict[str, Linear]], serving: ModelServing,
                        layout: Layout) -> str | None:
        """Why the engine refuses the routed-expert bank as a whole after loading (None: it does not)."""
        return None

    def experts_deviations(self, method: str, module_name: str, per_expert: dict[int, dict[str, Linear]],
                           serving: ModelServing, layout: Layout) -> list[Deviation]:
        """What the engine's post-processing of a loaded routed-expert bank computes differently (beyond the
        scale use every engine shares, ``experts_scale_deviations``)."""
        return []

    def serve_flags(self, layout: Layout, serving: ModelServing) -> list[str]:
        """Serve-command flags this export needs on this engine (each with its reason)."""
        return []

    def remap_kv_scale(self, name: str, params: set[str]) -> tuple[str, bool]:
        """The engine's ``maybe_remap_kv_scale_name``: the parameter name it tries, and whether it exists
        (when not, the engine drops the scale with a warning)."""
        raise NotImplementedError

    def mixed_algo(self, qv: QuantView, prefix: str) -> str | None:
        for name in self.mixed_candidates(prefix):
            if name in qv.quantized_layers:
                return qv.quantized_layers[name]
        base, _, proj = prefix.rpartition(".")
        if proj in qv.packed:
            algos = {qv.quantized_layers[f"{base}.{s}"] for s in qv.packed[proj] if f"{base}.{s}" in qv.quantized_layers}
            if len(algos) > 1:
                raise Refuse(prefix, f"{self.name}: mixed quant_algo within fused layer {prefix}: {sorted(algos)}; all "
                                     "shards must use the same quantization")
            if algos:
                return algos.pop()
        return next((algo for key, algo in qv.quantized_layers.items() if key.startswith(prefix + ".")), None)

    def _method(self, qv: QuantView, prefix: str, single: Mapping[str, str]) -> str:
        if qv.algo == "MIXED_PRECISION":
            return self.mixed_methods.get(self.mixed_algo(qv, prefix) or "", "bf16")
        return single.get(qv.algo, qv.algo.lower())

    def linear_method(self, qv: QuantView, prefix: str) -> str:
        """The method (a ``Linear.fmt`` value, "bf16" for unquantized) the engine builds at ``prefix``."""
        return "bf16" if self.linear_excluded(qv, prefix) else self._method(qv, prefix, self.single_methods)

    def experts_method(self, qv: QuantView, prefix: str) -> str:
        return "bf16" if self.experts_excluded(qv, prefix) else self._method(qv, prefix, self.single_expert_methods)

    def why(self, qv: QuantView, prefix: str, method: str) -> str:
        """How the config made the engine build ``prefix`` as ``method`` (for refusal messages)."""
        if method != "bf16":
            text = f"{qv.source}: quant_algo {qv.algo}, and no exclude entry matches {prefix}"
            if qv.algo != "MIXED_PRECISION" and prefix.rsplit(".", 1)[-1] not in qv.packed:
                text += " (a name the engine's packed_modules_mapping does not list: only an entry matching it excludes it)"
            return text
        if self.linear_excluded(qv, prefix):
            return f"{prefix} matches the exclude list of {qv.source}"
        if qv.algo != "MIXED_PRECISION":
            return f"{qv.source}: quant_algo {qv.algo}"
        algo = self.mixed_algo(qv, prefix)
        if algo is None:
            text = f"no quantized_layers entry of {qv.source} resolves to {prefix}"
            if any(k.startswith(f"language_model.{prefix}") for k in qv.quantized_layers):
                text += (" (the entries are named language_model.*; the engine's class names its modules without "
                         "that prefix and its per-layer lookup does not strip it)")
            return text
        return (f"quantized_layers gives {prefix} {algo}, which {self.name}'s MIXED_PRECISION config does not "
                f"dispatch (only {sorted(self.mixed_methods)}), so it builds the layer unquantized")

    # ------------------------------------------------------------------ the replay

    def replay(self, layout: Layout, serving: ModelServing, *, numerics: bool = True) -> EngineResult:
        result = EngineResult(self.name)
        try:
            qv = self.quant_view(layout, serving)
        except Refuse as r:
            result.refusals.append(r.refusal)
            return result
        dense, experts = split_modules(layout, serving)
        for module in dense:
            try:
                result.deviations += self._dense(layout, serving, qv, module, numerics)
            except Refuse as r:
                result.refusals.append(r.refusal)
        for module_name, per_expert in experts.items():
            try:
                result.deviations += self._experts(layout, serving, qv, module_name, per_expert, numerics)
            except Refuse as r:
                result.refusals.append(r.refusal)
        result.deviations += self._kv_scales(layout, serving, qv, numerics)
        result.refusals.sort(key=lambda r: r.tensor)
        result.serve_flags = self.serve_flags(layout, serving)
        return result

    def _kv_scales(self, layout: Layout, serving: ModelServing, qv: QuantView, numerics: bool) -> list[Deviation]:
        """KV-cache scales the engine drops (its remap lands on no parameter): the cache then uses 1.0."""
        dropped: dict[str, str] = {}
        for name in sorted(layout.kv_scales):
            engine_name = serving.engine_prefix(name)
            attn = engine_name.rpartition(".self_attn.")[0] + ".self_attn"
            params = {f"{attn}.{p}" for p in serving.kv_scale_params} if qv.kv_algo else set()
            if serving.kv_scale_rename is not None:
                target = serving.kv_scale_rename(engine_name)
                exists = target in params
            else:
                target, exists = self.remap_kv_scale(engine_name, params)
            if not exists:
                dropped[name] = f"{self.name} remaps it to {target}, which is no parameter ({serving.kv_note}): dropped"
        return kv_deviations(layout, dropped, numerics)

    def _dense(self, layout, serving, qv, module: EngineModule, numerics: bool) -> list[Deviation]:
        ignored = serving.ignored_reason(module.name)
        if ignored:  # skipped without an error: not a refusal, the served numbers are simply not these
            return [Deviation(module.name, f"its tensors land in no parameter: {ignored}", math.inf)]
        quantized = [p for p in module.pieces if p.fmt != "bf16"]
        built_plain = serving.unquantized_reason(module.name)
        for piece in quantized:
            reason = built_plain or serving.format_reason(module.name, piece.fmt)
            if reason:
                raise Refuse(piece.tensor_name(), f"stored {piece.fmt}, but {reason}")
        if built_plain:
            return []
        try:
            method = self.linear_method(qv, serving.engine_prefix(module.name))
        except Refuse as r:  # a config-level refusal is reported at the module's first tensor
            raise Refuse(module.pieces[0].tensor_name(), r.refusal.reason) from None
        prefix = serving.engine_prefix(module.name)
        for piece in module.pieces:
            if method == FP8.engine_method and _fp8_without_scale(piece):
                raise self.missing_fp8_scale(piece)
            if piece.fmt != method:
                where = prefix if len(module.pieces) > 1 else "it"
                raise Refuse(piece.tensor_name(), f"stored {piece.fmt}, but {self.name} builds {where} as "
                                                  f"{method} ({self.why(qv, prefix, method)})")
            problem = self.tensor_problem(method, piece)
            if problem:
                raise Refuse(piece.tensor_name(), problem)
        problem = self.module_problem(method, module, serving)
        if problem:
            raise Refuse(module.pieces[0].tensor_name(), problem)
        if numerics and len(module.pieces) > 1 and method != "bf16":
            return fused_scale_deviations(layout, module, method)
        return []

    def _experts(self, layout, serving, qv, module_name: str, per_expert: dict[int, dict[str, Linear]],
                 numerics: bool) -> list[Deviation]:
        pieces = [lin for projs in per_expert.values() for lin in projs.values()]
        quantized = [p for p in pieces if p.fmt != "bf16"]
        prefix = serving.engine_prefix(module_name)
        method = self.experts_method(qv, prefix)
        for piece in sorted(pieces, key=lambda p: p.name):
            if method == NVFP4.engine_method and piece.fmt == W4A16_NVFP4.engine_method:
                raise self.missing_input_scale(method, piece)
            if piece.fmt != method:
                raise Refuse(piece.tensor_name(), f"stored {piece.fmt}, but {self.name} builds the routed experts "
                                                  f"{prefix} as {method} ({self.why(qv, prefix, method)})")
            problem = self.tensor_problem(method, piece)
            if problem:
                raise Refuse(piece.tensor_name(), problem)
        problem = self.experts_problem(method, per_expert, serving, layout)
        if problem:
            raise Refuse(min(pieces, key=lambda p: p.name).tensor_name(), problem)
        post = self.experts_deviations(method, module_name, per_expert, serving, layout)
        if not numerics or not quantized:
            return post
        return experts_scale_deviations(layout, module_name, per_expert, serving.gate_up, method) + post


# ---------------------------------------------------------------------- shared pieces of the replay


def split_modules(layout: Layout, serving: ModelServing) -> tuple[list[EngineModule], dict[str, dict]]:
    """Dense engine modules (fused groups applied) and routed experts ``module -> expert -> proj -> Linear``."""
    expert_re = re.compile(serving.expert_re)
    experts: dict[str, dict[int, dict[str, Linear]]] = {}
    by_parent: dict[str, dict[str, Linear]] = {}
    for name, linear in sorted(layout.linears.items()):
        m = expert_re.fullmatch(name)
        if m is not None:
            experts.setdefault(m["module"], {}).setdefault(int(m["expert"]), {})[m["proj"]] = linear
            continue
        parent, _, last = name.rpartition(".")
        by_parent.setdefault(parent, {})[last] = linear
    modules: list[EngineModule] = []
    for parent, children in by_parent.items():
        for fused in serving.fused:
            if all(p in children for p in fused.pieces):
                modules.append(EngineModule(f"{parent}.{fused.engine_name}",
                                            tuple(children.pop(p) for p in fused.pieces), fused.merged))
        modules += [EngineModule(f"{parent}.{last}", (lin,)) for last, lin in children.items()]
    modules.sort(key=lambda m: m.pieces[0].name)
    return modules, experts


def _expect(piece: Linear, part: str, dtype: torch.dtype, shape: tuple[int, ...] | None) -> str | None:
    """Why ``piece``'s ``part`` does not fit the engine's parameter (None: it does). vLLM's and SGLang's weight
    loaders ``copy_`` into the parameter, which converts by value: a float stored narrower than an fp32 parameter
    (a bf16 ``weight_scale_2``) arrives exact; an integer stored where the parameter is a float (an E4M3 block scale
    stored uint8) arrives as its integer values -- loaded without a word, served as garbage (raised here)."""
    meta = piece.tensors.get(part)
    if meta is None:
        return f"has no {part}"
    shape_ok = _numel(meta.shape) == 1 if shape is None else meta.shape == shape
    if meta.dtype != dtype and not (shape_ok and _exact_copy(meta.dtype, dtype)):
        if shape_ok and not meta.dtype.is_floating_point and dtype.is_floating_point:
            raise Refuse(piece.tensor_name(part), (
                f"{part} is {meta}, the engine's parameter {str(dtype).removeprefix('torch.')}: the weight loader's "
                "copy_ converts it by value (the stored bytes become the integers 0..255), loaded without an error"),
                verdict=GARBAGE, rule="scale-dtype-converted")
        return f"{part} is {meta}, the engine's parameter is {str(dtype).removeprefix('torch.')}"
    if shape is not None and meta.shape != shape:
        return f"{part} is {meta}, the engine's parameter has shape {list(shape)}"
    if shape is None and _numel(meta.shape) != 1:
        return f"{part} is {meta}, the engine reads one per-tensor value"
    return None


def _exact_copy(stored: torch.dtype, param: torch.dtype) -> bool:
    """``param.copy_(stored values)`` is exact: a narrower float into an fp32 parameter (every bf16, fp16 and FP8
    value is an fp32 value)."""
    return stored.is_floating_point and param == torch.float32 and torch.finfo(stored).bits < 32


def _fp8_without_scale(piece: Linear) -> bool:
    weight = piece.tensors.get("weight")
    return weight is not None and weight.dtype == torch.float8_e4m3fn and "weight_scale" not in piece.tensors


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def standard_tensor_problem(method: str, piece: Linear) -> str | None:
    """The ModelOpt parameter layouts vLLM and SGLang create (``create_weights`` of their NVFP4/FP8
    linear and MoE methods): the scheme's exported layout (``Scheme.layout``), per-tensor scales read
    as one value whatever their shape: NVFP4 ``weight`` U8 [out, in/2], ``weight_scale`` E4M3
    [out, in/16], per-tensor ``weight_scale_2``/``input_scale``; FP8 ``weight`` E4M3 [out, in],
    per-tensor scales. Block formats are the engines' own business (``tensor_problem`` overrides)."""
    scheme = scheme_of_method(method)
    if scheme is None or not scheme.weights.per_tensor_scale:
        return None
    out_f, in_f = piece.shape
    multiple = scheme.weights.in_features_multiple
    if in_f % multiple:
        return f"in_features={in_f} is not a multiple of {multiple} ({scheme.weights.name.upper()} create_weights refuses it)"
    for part, dtype, shape in scheme.layout(piece.shape):
        problem = _expect(piece, part, dtype, shape or None)  # shape (): one per-tensor value
        if problem:
            return problem
    return None


def fused_scale_deviations(layout: Layout, module: EngineModule, method: str) -> list[Deviation]:
    """What the engine's one fused parameter does to pieces whose per-tensor scales differ.

    NVFP4 (vLLM ``ModelOptNvFp4LinearMethod`` / SGLang ``ModelOptFp4LinearMethod``
    ``process_weights_after_loading``): ``weight_scale_2`` and ``input_scale`` become the max over
    the shards and the block scales are left as written, so a piece with global scale ``s`` is read
    as ``codes * block * max(s)``: every element grows by exactly ``max(s)/s`` (no need to dequantize
    whole tensors to know it). FP8 per-tensor (``requantize_with_max_scale``): the engine dequantizes
    each piece with its own scale and requantizes with the max, an E4M3 rounding we replay exactly.
    """
    out: list[Deviation] = []
    names = ", ".join(p.name.rpartition(".")[2] for p in module.pieces)
    scheme = scheme_of_method(method)
    if scheme is None:
        return out
    wkey = scheme.weights.global_scale_key
    if wkey is not None:
        scales = [float(layout.value(p.tensor_name(wkey))) for p in module.pieces]
        top = max(scales)
        if any(s != top for s in scales):
            if scheme.weights.fused_requantized:
                err = max(_fp8_requant_error(layout, p, s, top) for p, s in zip(module.pieces, scales))
                what = f"{wkey} differ across {names} ({min(scales):.6g}..{top:.6g}); the engine requantizes to the max"
            else:
                err = max(top / s - 1.0 for s in scales)
                what = (f"{wkey} differ across {names} ({min(scales):.6g}..{top:.6g}); the engine reads all "
                        f"with the max, block scales unchanged")
            out.append(Deviation(module.name, what, err, rule="fused-scales-max"))
    if scheme.inputs is not None:
        inputs = [float(layout.value(p.tensor_name("input_scale"))) for p in module.pieces]
        top = max(inputs)
        if any(s != top for s in inputs):
            out.append(Deviation(
                module.name, f"input_scale differ across {names}; the engine quantizes the shared input with the max",
                max(top / s - 1.0 for s in inputs), rule="fused-scales-max"))
    return out


def _fp8_requant_error(layout: Layout, piece: Linear, scale: float, top: float) -> float:
    if scale == top:
        return 0.0
    written = fp8n.fp8_dequantize_per_tensor(layout.value(piece.tensor_name()), scale)
    served = fp8n.fp8_dequantize_per_tensor(*fp8n.fp8_quantize_per_tensor(written, top))
    nz = written != 0
    return float(((served - written).abs()[nz] / written.abs()[nz]).max()) if bool(nz.any()) else 0.0


def experts_scale_deviations(layout: Layout, module_name: str, per_expert: dict[int, dict[str, Linear]],
                             gate_up: tuple[str, str], method: str) -> list[Deviation]:
    """Routed experts as vLLM's ``ModelOptNvFp4FusedMoE`` / SGLang's ``ModelOptNvFp4FusedMoEMethod`` read
    them: w13 takes w1's ``weight_scale_2`` for both halves (``w13_weight_scale_2[:, 0]``, a warning
    when w3's differs), and one input scale per layer and GEMM (the max over experts and shards)."""
    out: list[Deviation] = []
    w1, w3 = gate_up
    scheme = scheme_of_method(method)
    if scheme is None:
        return out
    if scheme.weights.global_scale_key is not None and not scheme.weights.fused_requantized:  # NVFP4's w13 read
        worst, where = 0.0, ""
        for e, projs in sorted(per_expert.items()):
            if w1 in projs and w3 in projs:
                s1 = float(layout.value(projs[w1].tensor_name("weight_scale_2")))
                s3 = float(layout.value(projs[w3].tensor_name("weight_scale_2")))
                err = abs(s1 / s3 - 1.0)
                if err > worst:
                    worst, where = err, f"expert {e}: {w1} {s1:.6g} vs {w3} {s3:.6g}"
        if worst:
            out.append(Deviation(module_name, f"{w1}/{w3} weight_scale_2 differ ({where}); the engine reads "
                                              f"{w3} with {w1}'s", worst, rule="w13-scale-2-read-with-w1s"))
    if scheme.inputs is not None:
        for gemm in ((w1, w3), tuple(p for p in next(iter(per_expert.values())) if p not in gate_up)):
            scales = [float(layout.value(projs[p].tensor_name("input_scale")))
                      for projs in per_expert.values() for p in gemm if p in projs]
            if scales and min(scales) != max(scales):
                out.append(Deviation(module_name, f"input_scale of {'/'.join(gemm)} differ across experts "
                                                  f"({min(scales):.6g}..{max(scales):.6g}); the engine uses the max",
                                     max(scales) / min(scales) - 1.0))
    return out


def kv_deviations(layout: Layout, reasons: Mapping[str, str], numerics: bool) -> list[Deviation]:
    """``reasons``: KV-scale tensor -> why the engine does not load it."""
    out = []
    for name, reason in sorted(reasons.items()):
        if numerics:
            value = float(layout.value(name))
            err = abs(1.0 / value - 1.0) if value else float("inf")
            what = f"{reason}; with an FP8 KV cache the engine uses scale 1.0, not {value:.6g}"
        else:
            err, what = float("nan"), reason
        out.append(Deviation(name, what, err))
    return out


def config_json_fields(cfg: dict, source: str, engine: str) -> tuple[str, str | None, list, dict]:
    """(quant_algo, KV algo, ignore list, quantized_layers) from ``config.json``'s ``quantization_config``
    (ModelOpt's ``convert_hf_quant_config_format`` layout), as the engines' ModelOpt configs read it."""
    if not str(cfg.get("quant_method", "")).lower().startswith("modelopt"):
        raise Refuse(source, f"quant_method is {cfg.get('quant_method')!r}, not modelopt: this check "
                             f"replays {engine}'s ModelOpt loader only")
    scheme = cfg.get("kv_cache_scheme")
    kv = KV_FP8.algo if isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8 else None
    return str(cfg.get("quant_algo") or "").upper(), kv, cfg.get("ignore") or [], cfg.get("quantized_layers", {})


def modelopt_config(layout: Layout) -> tuple[dict, str] | None:
    """The quant config an engine reads: ``config.json``'s ``quantization_config`` first, else
    ``hf_quant_config.json`` (vLLM/SGLang ``weight_utils.get_quant_config``)."""
    if isinstance(layout.quant, dict):
        return layout.quant, "config.json quantization_config"
    if isinstance(layout.hf_quant, dict):
        return layout.hf_quant, "hf_quant_config.json"
    return None
