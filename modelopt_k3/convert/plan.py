"""The plan: recipe decisions per checkpoint name -> per-module jobs and each shard's outputs."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from .. import __version__
from ..checkpoint import CheckpointError, read_config
from ..export.modelopt_format import (
    linear_layout,
)
from ..models.spec import ModelSpec, get_spec
from ..numerics.constants import MXFP4_BLOCK
from ..recipe import QuantFormat, Recipe, RecipeError
from ..source_check import SourceLayout, check_experts
from .source import _scan_source, _SrcTensor
from .state import RECORD_VERSION

_EMBEDDING_RE = re.compile(r"(^|\.)(embed_tokens|embed_in|tok_embeddings|word_embeddings|wte|wpe|embeddings)$")
_PACKED, _SCALE = "weight_packed", "weight_scale"


class _Out(NamedTuple):  # a NamedTuple: a Kimi-K3 plan makes ~10**6 of them
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(slots=True)
class _ModuleJob:
    """One Linear whose weight is converted. ``kind``: nvfp4_cast (MXFP4 source, lossless cast),
    quant (quantize the plain or decoded weight with ``fmt``), decode (MXFP4 -> plain weight)."""

    name: str
    kind: str
    fmt: QuantFormat | None
    sources: tuple[str, ...]  # weight_packed + weight_scale, or weight
    shape: tuple[int, int]  # (out, in) of the logical weight
    group: tuple[str, ...]  # modules sharing weight_scale_2 (itself included)

    @property
    def outputs(self) -> tuple[_Out, ...]:
        return _outputs(self.name, self.fmt, self.shape)


@dataclass
class _Plan:
    src: Path
    files: list[str]
    sizes: dict[str, int]
    tensors: dict[str, _SrcTensor]
    jobs: dict[str, list[str | _ModuleJob]]  # file -> copy keys and module jobs, in source order
    modules: dict[str, _ModuleJob]
    layer_algos: dict[str, str]
    left_bf16: dict[str, str]
    dtype: torch.dtype
    fingerprint: str
    source: SourceLayout  # what the shared source check found (load_pretrained runs the same one)


def _model_dtype(raw: dict) -> torch.dtype:
    """The dtype the model path loads weights in (``load._config_dtype`` on the raw config)."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    name = text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"config.json names dtype {name!r}, which torch does not know")
    return dtype


def _check_source_scheme(raw: dict, spec: ModelSpec, config_path: Path) -> None:
    """Refuse packed tensors whose compressed-tensors scheme is not MXFP4 (format, 4-bit float, group 32)."""
    qcfg = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not isinstance(qcfg, dict):
        raise CheckpointError(f"{config_path}: the checkpoint has packed tensors but no quantization_config")
    groups = qcfg.get("config_groups") or {}
    formats = {g.get("format") or qcfg.get("format") for g in groups.values()} or {qcfg.get("format")}
    formats.discard(None)
    if len(formats) != 1 or not formats <= set(spec.source_formats):
        raise CheckpointError(
            f"{config_path}: packed scheme {sorted(map(str, formats))} is not one this converter decodes "
            f"({sorted(spec.source_formats)})"
        )
    for name, g in groups.items():
        w = g.get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", MXFP4_BLOCK):
            raise CheckpointError(f"{config_path}: quantization_config group {name!r} is not MXFP4: {w}")


def _outputs(name: str, fmt: QuantFormat | None, shape: tuple[int, int]) -> tuple[_Out, ...]:
    if fmt is None:  # a routed expert left unquantized: decoded, written as bf16 (as the model path does)
        return (_Out(f"{name}.weight", torch.bfloat16, shape),)
    layout = linear_layout(fmt.weights, shape, input_scale=fmt.inputs is not None)
    return tuple(_Out(f"{name}.{suffix}", dtype, shp) for suffix, dtype, shp in layout)


def _is_linear(module: str, parts: dict[str, _SrcTensor]) -> bool:
    if _EMBEDDING_RE.search(module):
        return False
    if set(parts) == {_PACKED, _SCALE}:
        return True
    weight = parts.get("weight")
    return (
        weight is not None
        and len(weight.shape) == 2
        and weight.dtype.is_floating_point
        and set(parts) <= {"weight", "bias"}
    )


def _reason(entry) -> str:
    if entry is None:
        return "no recipe entry matches"
    return entry.reason or f"disabled by {entry.source}"


def _fingerprint(recipe: Recipe, header_digest: str) -> str:
    body = {
        "record_version": RECORD_VERSION,
        "modelopt_k3": __version__,
        "recipe": recipe.name,
        "recipe_entries": recipe.to_dict(),
        "source_headers": header_digest,
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def _build_plan(src: Path, recipe: Recipe) -> _Plan:
    files, tensors, sizes, header_digest = _scan_source(src)
    config_path = src / "config.json"
    raw = read_config(src)
    spec = get_spec(raw.get("model_type", ""))
    source = check_experts(tensors, raw, spec)  # every routed expert the config asks for, as load_pretrained
    expert_re = re.compile(spec.expert_key_regex)
    dtype = _model_dtype(raw)
    if recipe.kv_cache is not None:
        raise RecipeError(
            f"recipe {recipe.name} quantizes the KV cache ({recipe.kv_cache}), which needs calibration data; "
            "the calibration-free converter cannot produce k_scale/v_scale (use hf_ptq)"
        )

    # module -> tensor part -> source tensor; experts keyed by their per-expert Linear name.
    modules: dict[str, dict[str, _SrcTensor]] = {}
    expert_of: dict[str, tuple[str, int, str]] = {}  # module -> (experts module, expert id, projection)
    for key, t in tensors.items():
        m = expert_re.match(key)
        if m is not None:
            name = f"{m['module']}.{m['expert']}.{m['proj']}"
            expert_of[name] = (m["module"], int(m["expert"]), m["proj"])
            part = m["tensor"]
        else:
            name, _, part = key.rpartition(".")
        modules.setdefault(name, {})[part] = t
    if any(_PACKED in parts for parts in modules.values()):
        _check_source_scheme(raw, spec, config_path)

    jobs_by_anchor: dict[str, _ModuleJob] = {}
    plan_modules: dict[str, _ModuleJob] = {}
    layer_algos: dict[str, str] = {}
    left_bf16: dict[str, str] = {}
    shapes: dict[str, tuple[int, int]] = {}
    needs_calib: list[str] = []
    expert_formats: dict[tuple[str, str], set[QuantFormat | None]] = {}
    for name, parts in modules.items():
        is_expert = name in expert_of
        if not (is_expert or _is_linear(name, parts)):
            continue
        packed = _PACKED in parts
        if is_expert and set(parts) not in ({_PACKED, _SCALE}, {"weight"}):
            raise CheckpointError(f"routed expert {name} has tensors {sorted(parts)}; expected "
                                  f"{_PACKED}+{_SCALE} (MXFP4) or weight")
        if packed:
            p, s = parts[_PACKED], parts[_SCALE]
            shape = (p.shape[0], p.shape[1] * 2)
            if p.dtype != torch.uint8 or s.dtype != torch.uint8 or s.shape != (shape[0], shape[1] // MXFP4_BLOCK):
                raise CheckpointError(
                    f"{src / p.file}: {name} is not MXFP4-packed: {_PACKED} {p.dtype} {list(p.shape)}, "
                    f"{_SCALE} {s.dtype} {list(s.shape)}"
                )
            sources = (p.key, s.key)
        else:
            shape = tuple(parts["weight"].shape)
            sources = (parts["weight"].key,)
        shapes[name] = shape
        fmt, entry = recipe.resolve(name)
        if is_expert:
            experts_module, _, proj = expert_of[name]
            expert_formats.setdefault((experts_module, proj), set()).add(fmt)
        if fmt is None:
            if is_expert:
                left_bf16[f"{expert_of[name][0]}.*.{expert_of[name][2]}"] = _reason(entry)
            else:
                left_bf16[name] = _reason(entry)
            if not packed:
                continue  # a plain Linear left as it is: its tensors are copied
            kind = "decode"
        else:
            if fmt.needs_calibration:
                needs_calib.append(f"{name} ({fmt.algo}, pattern {entry.pattern!r} from {entry.source})")
                continue
            layer_algos[name] = fmt.algo
            kind = "nvfp4_cast" if packed and fmt.weights == "nvfp4" else "quant"
        group = (name,)
        if is_expert:
            experts_module, e, proj = expert_of[name]
            for members in spec.shared_scale_groups:
                if proj in members:
                    group = tuple(f"{experts_module}.{e}.{p}" for p in members if f"{experts_module}.{e}.{p}" in modules)
        job = _ModuleJob(name, kind, fmt, sources, shape, group)
        plan_modules[name] = job
        jobs_by_anchor[sources[0]] = job

    if needs_calib:
        raise RecipeError(
            f"recipe {recipe.name} needs calibration data for {len(needs_calib)} module(s), e.g. "
            f"{'; '.join(needs_calib[:3])}: the calibration-free converter needs a constant input_amax "
            "(or weight-only formats); use hf_ptq to calibrate"
        )
    for (experts_module, proj), fmts in expert_formats.items():
        if len(fmts) > 1:
            raise RecipeError(
                f"recipe {recipe.name}: the experts of {experts_module} get different formats for {proj} "
                f"({sorted(str(f) if f else 'bf16' for f in fmts)}); all experts of one layer must share one format"
            )
    for job in plan_modules.values():
        if len(job.group) == 1:
            continue
        fmts = {str(plan_modules[m].fmt) if m in plan_modules and plan_modules[m].fmt else "bf16" for m in job.group}
        if len(fmts) > 1:
            raise RecipeError(
                f"recipe {recipe.name}: {', '.join(job.group)} share one weight_scale_2/input_scale "
                f"(one fused kernel) and must get the same format, got {sorted(fmts)}"
            )
    recipe.check_against(shapes)

    consumed = {k for job in plan_modules.values() for k in job.sources}
    jobs: dict[str, list[str | _ModuleJob]] = {f: [] for f in files}
    for key, t in sorted(tensors.items(), key=lambda kv: (kv[1].file, kv[1].offset)):
        if key in jobs_by_anchor:
            jobs[t.file].append(jobs_by_anchor[key])
        elif key not in consumed:
            jobs[t.file].append(key)
    return _Plan(
        src=src,
        files=files,
        sizes=sizes,
        tensors=tensors,
        jobs=jobs,
        modules=plan_modules,
        layer_algos=layer_algos,
        left_bf16=left_bf16,
        dtype=dtype,
        fingerprint=_fingerprint(recipe, header_digest),
        source=source,
    )
