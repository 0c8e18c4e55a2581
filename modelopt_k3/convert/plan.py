"""The plan: recipe decisions per checkpoint name -> per-module jobs and each shard's outputs."""

from __future__ import annotations

import hashlib
import json
import math
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
from ..quant.decisions import Decision, DecisionTable, InventoryError, decide
from ..quant.shared_inputs import discover_shared_inputs
from ..recipe import QuantFormat, Recipe, RecipeError
from ..source_check import SourceLayout, check_experts
from .source import _scan_source, _SrcTensor
from .state import RECORD_VERSION

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
    input_amax: float | None = None  # constant input amax (its group's max), when inputs are quantized

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
    table: DecisionTable
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


def _fingerprint(recipe: Recipe, header_digest: str, table: DecisionTable) -> str:
    body = {
        "record_version": RECORD_VERSION,
        "modelopt_k3": __version__,
        "recipe": recipe.name,
        "recipe_entries": recipe.to_dict(),
        "source_headers": header_digest,
        "shared_input_groups": sorted(table.groups),  # they change the bytes of grouped modules
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def _shared_input_rules(src: Path, raw: dict, spec: ModelSpec, trust_remote_code: bool):
    """A provider of the checkpoint's shared-input rules (a probe of its own code, run only when the
    recipe needs them), or None without trust_remote_code."""
    if not trust_remote_code or spec.probe_model is None:
        return None

    def probe():
        from ..load import resolve_model_class

        spec.build(src)
        model_cls, config = resolve_model_class(src, raw, trust_remote_code=True)
        return discover_shared_inputs(spec, model_cls, config)

    return probe


def _expert_jobs(d: Decision, spec: ModelSpec, tensors: dict[str, _SrcTensor]) -> list[_ModuleJob]:
    module, _, proj = d.name.rpartition(".*.")
    partners = next((g for g in spec.shared_scale_groups if proj in g), (proj,))
    kind = "decode" if d.format is None else "nvfp4_cast" if d.packed and d.format.weights == "nvfp4" else "quant"
    jobs = []
    for e in d.experts:
        name = f"{module}.{e}.{proj}"
        parts = (_PACKED, _SCALE) if d.packed else ("weight",)
        group = tuple(f"{module}.{e}.{p}" for p in partners if f"{module}.{e}.{p}.{parts[0]}" in tensors)
        amax = d.format.input_amax if d.format is not None else None
        jobs.append(_ModuleJob(name, kind, d.format, tuple(f"{name}.{t}" for t in parts), d.shape, group, amax))
    return jobs


def _build_plan(src: Path, recipe: Recipe, *, trust_remote_code: bool = False) -> _Plan:
    files, tensors, sizes, header_digest = _scan_source(src)
    config_path = src / "config.json"
    raw = read_config(src)
    spec = get_spec(raw.get("model_type", ""))
    source = check_experts(tensors, raw, spec)  # every routed expert the config asks for, as load_pretrained
    dtype = _model_dtype(raw)
    if recipe.kv_cache is not None:
        raise RecipeError(
            f"recipe {recipe.name} quantizes the KV cache ({recipe.kv_cache}), which needs calibration data; "
            "the calibration-free converter cannot produce k_scale/v_scale (use hf_ptq)"
        )
    if any(key.endswith(f".{_PACKED}") for key in tensors):
        _check_source_scheme(raw, spec, config_path)
    inventory = {key: (t.dtype, t.shape) for key, t in tensors.items()}
    try:
        table = decide(inventory, spec, recipe, _shared_input_rules(src, raw, spec, trust_remote_code))
    except InventoryError as e:
        raise CheckpointError(f"{src}: {e}") from None

    plan_modules: dict[str, _ModuleJob] = {}
    needs_calib: list[str] = []
    for name, d in table.decisions.items():
        if d.kind == "experts" and (d.quantized or d.packed):
            plan_modules.update((job.name, job) for job in _expert_jobs(d, spec, tensors))
        elif d.kind == "linear" and d.quantized:
            group = table.groups.get(d.group, (name,))
            plan_modules[name] = _ModuleJob(
                name, "quant", d.format, (f"{name}.weight",), d.shape, group, table.group_input_amax(name)
            )
        if d.quantized and table.group_input_amax(name) is None and d.format.inputs is not None:
            needs_calib.append(f"{name} ({d.format.algo})")
    if needs_calib:
        raise RecipeError(
            f"recipe {recipe.name} needs calibration data for {len(needs_calib)} module(s), e.g. "
            f"{'; '.join(needs_calib[:3])}: the calibration-free converter needs a constant input_amax "
            "(or weight-only formats); use hf_ptq to calibrate"
        )
    table.check_groups_known()

    jobs_by_anchor = {job.sources[0]: job for job in plan_modules.values()}
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
        table=table,
        dtype=dtype,
        fingerprint=_fingerprint(recipe, header_digest, table),
        source=source,
    )
