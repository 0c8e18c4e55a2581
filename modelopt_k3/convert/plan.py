"""The plan: the source's checked headers and the recipe's decisions -> per-module jobs and each shard's outputs.

``_build_plan`` runs on every rank before anything is written; each step below refuses what the
converter cannot do, naming the tensor, the file or the recipe.
"""

from __future__ import annotations

import hashlib
import json
from functools import partial
from pathlib import Path

import torch

from .. import __version__
from ..checkpoint import CheckpointError, CheckpointReader, TensorInfo, read_config
from ..checkpoint.source_check import check_config, check_dense_against_config, check_experts
from ..numerics.constants import MXFP4_BLOCK
from ..quant.decisions import Decision, DecisionTable, InventoryError, decide
from ..quant.shared_inputs import SharedInputRule, discover_shared_inputs
from ..recipe import Recipe, RecipeError
from ..spec import ModelSpec, get_spec
from .jobs import _ModuleJob, _Plan
from .state import RECORD_VERSION, stat_identity

_PACKED, _SCALE = "weight_packed", "weight_scale"


def _build_plan(src: Path, recipe: Recipe, *, trust_remote_code: bool = False) -> _Plan:
    reader = CheckpointReader(src)
    identity = {f: stat_identity(src / f) for f in reader.files}  # before any tensor byte is read
    raw = read_config(src)
    spec = get_spec(raw.get("model_type", ""))
    check_config(raw, spec)  # every field read below, named when missing
    source = check_experts(reader.headers(), raw, spec, reader.stored_name)  # every routed expert the config asks for, as load_pretrained
    check_dense_against_config(reader.headers(), raw, spec)  # the dense shapes config.json fixes (no model built)
    dtype = _model_dtype(raw)
    _refuse_kv_cache(recipe)
    fp8 = next((key for key in reader.headers() if key.endswith(".weight_scale_inv")), None)
    if fp8 is not None:  # decoded only by load_pretrained's converters so far (models/deepseek_v3/source.py)
        raise CheckpointError(f"{src}: block-FP8 source ({fp8}): the calibration-free converter does not decode "
                              "block-FP8 weights yet; quantize with modelopt-k3-ptq")
    if any(key.endswith(f".{_PACKED}") for key in reader.headers()):
        _check_source_scheme(raw, spec, src / "config.json")
    table = _decision_table(src, reader, raw, spec, recipe, trust_remote_code)
    modules = _module_jobs(table, spec, reader.headers())
    _refuse_calibration(table, recipe)
    table.check_groups_known()
    return _Plan(
        src=src,
        reader=reader,
        jobs=_shard_jobs(reader, modules),
        modules=modules,
        table=table,
        dtype=dtype,
        fingerprint=_fingerprint(recipe, reader.header_digest, table),
        source=source,
        identity=identity,
    )


def _model_dtype(raw: dict) -> torch.dtype:
    """The dtype the model path loads weights in (``load._config_dtype`` on the raw config)."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    name = text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"config.json names dtype {name!r}, which torch does not know")
    return dtype


def _refuse_kv_cache(recipe: Recipe) -> None:
    if recipe.kv_cache is not None:
        raise RecipeError(
            f"recipe {recipe.name} quantizes the KV cache ({recipe.kv_cache}), which needs calibration data; "
            "the calibration-free converter cannot produce k_scale/v_scale (use hf_ptq)"
        )


def _check_source_scheme(raw: dict, spec: ModelSpec, config_path: Path) -> None:
    """Refuse packed tensors whose compressed-tensors scheme is not MXFP4 (format, 4-bit float, group 32)."""
    qcfg = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not isinstance(qcfg, dict):
        raise CheckpointError(f"{config_path}: the checkpoint has packed tensors but no quantization_config")
    if qcfg.get("quant_method") in spec.loading.source_formats:  # a method that is one format (GPT-OSS's mxfp4)
        return
    groups = qcfg.get("config_groups") or {}
    formats = {g.get("format") or qcfg.get("format") for g in groups.values()} or {qcfg.get("format")}
    formats.discard(None)
    if len(formats) != 1 or not formats <= set(spec.loading.source_formats):
        raise CheckpointError(
            f"{config_path}: packed scheme {sorted(map(str, formats))} is not one this converter decodes "
            f"({sorted(spec.loading.source_formats)})"
        )
    for name, g in groups.items():
        w = g.get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", MXFP4_BLOCK):
            raise CheckpointError(f"{config_path}: quantization_config group {name!r} is not MXFP4: {w}")


def _decision_table(
    src: Path, reader: CheckpointReader, raw: dict, spec: ModelSpec, recipe: Recipe, trust_remote_code: bool
) -> DecisionTable:
    """The decision table the model path's ``quantize`` builds from the same checkpoint. Shared-input rules
    come from a probe of the model's own classes, run only when the recipe needs them and, for checkpoint
    code, only with ``trust_remote_code`` (None otherwise: the table then refuses what needs them)."""
    # The probe runs the model's classes: checkpoint code only for a remote-code class (transformers' own need no opt-in).
    may_probe = trust_remote_code or not spec.loading.model_class.remote_code
    rules = partial(_probe_shared_inputs, src, raw, spec) if may_probe and spec.quant.probe_model is not None else None
    try:
        return decide(reader.inventory(), spec, recipe, rules)
    except InventoryError as e:
        raise CheckpointError(f"{src}: {e}") from None


def _probe_shared_inputs(src: Path, raw: dict, spec: ModelSpec) -> tuple[SharedInputRule, ...]:
    spec.loading.build(src)
    model_cls, config = spec.loading.model_class.resolve(src, raw, trust_remote_code=True)
    return discover_shared_inputs(spec, model_cls, config)


def _module_jobs(table: DecisionTable, spec: ModelSpec, tensors: dict[str, TensorInfo]) -> dict[str, _ModuleJob]:
    """One job per Linear whose weight changes: quantized dense Linears and quantized or packed routed experts."""
    jobs: dict[str, _ModuleJob] = {}
    for name, d in table.decisions.items():
        if d.kind == "experts" and (d.quantized or d.packed):
            jobs.update((job.name, job) for job in _expert_jobs(d, spec, tensors))
        elif d.kind == "linear" and d.quantized:
            group = table.groups.get(d.group, (name,))
            jobs[name] = _ModuleJob(name, "quant", d.format, (f"{name}.weight",), d.shape, group,
                                    table.group_input_amax(name))
    return jobs


def _expert_jobs(d: Decision, spec: ModelSpec, tensors: dict[str, TensorInfo]) -> list[_ModuleJob]:
    module, _, proj = d.name.rpartition(".*.")
    partners = next((g for g in spec.quant.shared_scale_groups if proj in g), (proj,))
    kind = "decode" if d.format is None else "nvfp4_cast" if d.packed and d.format.weights.casts_from_mxfp4 else "quant"
    parts = (_PACKED, _SCALE) if d.packed else ("weight",)
    amax = d.format.input_amax if d.format is not None else None
    jobs = []
    for e in d.experts:
        name = f"{module}.{e}.{proj}"
        group = tuple(f"{module}.{e}.{p}" for p in partners if f"{module}.{e}.{p}.{parts[0]}" in tensors)
        jobs.append(_ModuleJob(name, kind, d.format, tuple(f"{name}.{t}" for t in parts), d.shape, group, amax))
    return jobs


def _refuse_calibration(table: DecisionTable, recipe: Recipe) -> None:
    """Refuse quantized inputs without a constant ``input_amax``: their scales need calibration data."""
    needs_calib = [
        f"{name} ({d.format.algo})"
        for name, d in table.decisions.items()
        if d.quantized and table.group_input_amax(name) is None and d.format.inputs is not None
    ]
    if needs_calib:
        raise RecipeError(
            f"recipe {recipe.name} needs calibration data for {len(needs_calib)} module(s), e.g. "
            f"{'; '.join(needs_calib[:3])}: the calibration-free converter needs a constant input_amax "
            "(or weight-only formats); use hf_ptq to calibrate"
        )


def _shard_jobs(reader: CheckpointReader, modules: dict[str, _ModuleJob]) -> dict[str, list[str | _ModuleJob]]:
    """Per source shard, in source order: a module job where its main tensor is stored, and the key of
    every tensor no job consumes (copied unchanged)."""
    tensors = reader.headers()
    by_anchor = {job.sources[0]: job for job in modules.values()}
    consumed = {k for job in modules.values() for k in job.sources}
    jobs: dict[str, list[str | _ModuleJob]] = {f: [] for f in reader.files}
    for key, t in sorted(tensors.items(), key=lambda kv: (kv[1].file, kv[1].offset)):
        if key in by_anchor:
            jobs[t.file].append(by_anchor[key])
        elif key not in consumed:
            jobs[t.file].append(key)
    return jobs


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
