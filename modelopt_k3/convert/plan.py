"""The plan: the source's checked headers and the recipe's decisions -> per-module jobs and each shard's outputs.

``_build_plan`` runs on every rank before anything is written; each step below refuses what the
converter cannot do, naming the tensor, the file or the recipe.
"""

from __future__ import annotations

import hashlib
import json
import re
from functools import partial
from pathlib import Path

import torch
from transformers.core_model_loading import WeightConverter

from .. import __version__
from ..checkpoint import CheckpointError, CheckpointReader, TensorInfo, read_config
from ..checkpoint.source_check import SourceLayout, check_config, check_dense_against_config, check_experts
from ..checkpoint.source_decode import SourceDecode, dense_decodes
from ..files.paths import stat_identity
from ..numerics.constants import MXFP4_BLOCK
from ..quant.block_fp8_source import block_fp8_passthrough
from ..quant.decisions import Decision, DecisionTable, InventoryError, decide
from ..quant.shared_inputs import SharedInputRule, discover_shared_inputs
from ..recipe import Recipe, RecipeError
from ..spec import CarriedModules, ModelSpec, PrepareContext, SpecError, get_spec
from ..spec.config import load_dtype
from ..spec.conversion import decode_op
from .jobs import _ModuleJob, _Plan
from .state import RECORD_VERSION

_PACKED, _SCALE = "weight_packed", "weight_scale"


def _build_plan(src: Path, recipe: Recipe, *, trust_remote_code: bool = False) -> _Plan:
    reader = CheckpointReader(src)
    identity = {f: stat_identity(src / f) for f in reader.files}  # before any tensor byte is read
    raw = read_config(src)
    spec = get_spec(raw.get("model_type", ""))
    check_config(raw, spec)  # every field read below, named when missing
    source = check_experts(reader.headers(), raw, spec, reader.stored_name)  # every routed expert the config asks for, as load_pretrained
    # the dense shapes config.json fixes (no model built); carried modules (MTP layers) were checked on their own
    check_dense_against_config({k: t for k, t in reader.headers().items() if k not in source.carried_keys}, raw, spec)
    dtype = load_dtype(raw)
    _refuse_kv_cache(recipe)
    # MXFP4-packed codes are uint8 (the lossless cast reads them); INT4 pack-quantized codes (int32) are decoded.
    if any(key.endswith(f".{_PACKED}") and t.dtype == torch.uint8 for key, t in reader.headers().items()):
        _check_source_scheme(raw, spec, src / "config.json")
    decode = _source_decode(src, reader, raw, spec, source, trust_remote_code)
    table = _decision_table(src, reader, raw, spec, recipe, trust_remote_code, source.carried)
    modules = _module_jobs(table, spec, reader.headers(), decode, dtype)
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
        decode=decode,
        identity=identity,
    )


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
    src: Path, reader: CheckpointReader, raw: dict, spec: ModelSpec, recipe: Recipe, trust_remote_code: bool,
    carried: CarriedModules | None = None,
) -> DecisionTable:
    """The decision table the model path's ``quantize`` builds from the same checkpoint. Shared-input rules
    come from a probe of the model's own classes, run only when the recipe needs them and, for checkpoint
    code, only with ``trust_remote_code`` (None otherwise: the table then refuses what needs them)."""
    # The probe runs the model's classes: checkpoint code only for a remote-code class (transformers' own need no opt-in).
    may_probe = trust_remote_code or not spec.loading.model_class.remote_code
    rules = partial(_probe_shared_inputs, src, raw, spec) if may_probe and spec.quant.probe_model is not None else None
    try:
        return decide(reader.inventory(), spec, recipe, rules, carried)
    except InventoryError as e:
        raise CheckpointError(f"{src}: {e}") from None


def _probe_shared_inputs(src: Path, raw: dict, spec: ModelSpec) -> tuple[SharedInputRule, ...]:
    spec.loading.build(src)
    model_cls, config = spec.loading.model_class.resolve(src, raw, trust_remote_code=True)
    return discover_shared_inputs(spec, model_cls, config)


def _source_decode(src: Path, reader: CheckpointReader, raw: dict, spec: ModelSpec, source: SourceLayout,
                   trust_remote_code: bool) -> SourceDecode:
    """How the model path decodes this source (``SourceDecode``): asked of the spec's converters only when some
    tensor is stored in a format they decode (block-FP8 dense Linears; routed experts stored encoded but not
    MXFP4-packed), so a plain or MXFP4 source resolves no model class."""
    dense = dense_decodes(reader, spec.loading.dense_converters)
    key_re = re.compile(spec.experts.key_regex)  # the carried modules' experts (MTP layers) decode the same way
    expert_parts = {k.rpartition(".")[2] for k in source.expert_keys | source.carried_keys if key_re.match(k)}
    if not dense and (source.packed_experts or expert_parts <= {"weight"}):
        return SourceDecode()
    spec.loading.build(src)
    model_cls, config = spec.loading.model_class.resolve(src, raw, trust_remote_code=trust_remote_code)
    try:
        chains = spec.loading.converters(PrepareContext(model_cls, config, src, packed_experts=source.packed_experts))
    except SpecError as e:
        raise CheckpointError(f"{src}: {e}") from None
    ops = tuple(op for op in (decode_op(c) for c in chains if isinstance(c, WeightConverter)) if op is not None)
    decode = SourceDecode(dense, () if source.packed_experts else ops, config)
    if not source.packed_experts and expert_parts - {"weight"} and decode.expert_op(expert_parts) is None:
        raise CheckpointError(f"{src}: routed experts stored as {sorted(expert_parts)}, which none of the "
                              f"{spec.model_type} spec's converters decodes")
    return decode


def _module_jobs(table: DecisionTable, spec: ModelSpec, tensors: dict[str, TensorInfo], decode: SourceDecode,
                 dtype: torch.dtype) -> dict[str, _ModuleJob]:
    """One job per Linear whose weight changes: quantized dense Linears (block-FP8 ones whose format holds the
    source's block copied as stored, as the model path writes them), quantized, packed or encoded routed
    experts, and kept dense Linears stored encoded (block-FP8: written decoded, as the model path does)."""
    jobs: dict[str, _ModuleJob] = {}
    parts: dict[str, set[str]] = {}
    if decode.experts:  # which encoded form each expert Linear is stored in
        for key in tensors:
            module, _, part = key.rpartition(".")
            parts.setdefault(module, set()).add(part)
    for name, d in table.decisions.items():
        if d.kind == "experts" and (d.quantized or d.packed or decode.experts):
            jobs.update((job.name, job) for job in _expert_jobs(d, spec, tensors, decode, parts))
        elif d.kind == "linear" and d.quantized:
            if d.format.weights.holds_block_fp8 is not None:  # the model path's decision (quant/block_fp8_source.py)
                where, _ = block_fp8_passthrough(name, d.format.weights, d.shape, decode.dense, tensors, decode.config)
                if where is not None:  # written as the source's codes and scales: a copy, no decode
                    jobs[name] = _ModuleJob(name, "block_fp8_copy", d.format, (where.codes, where.scales), d.shape,
                                            (name,))
                    continue
            group = table.groups.get(d.group, (name,))
            weight = f"{name}.weight"
            coded = weight if weight in decode.dense else None
            jobs[name] = _ModuleJob(name, "quant", d.format, _dense_sources(weight, decode), d.shape, group,
                                    table.group_input_amax(name), decode=coded)
    quantized = {f"{name}.weight" for name, job in jobs.items() if job.kind in ("quant", "block_fp8_copy")}
    for target in sorted(set(decode.dense) - quantized):
        d = table.decisions.get(target.removesuffix(".weight"))
        if d is None or d.kind != "linear" or not target.endswith(".weight"):
            raise CheckpointError(f"{target} is stored in a format the converter decodes only for Linear weights")
        jobs[target] = _ModuleJob(target, "dense_decode", None, _dense_sources(target, decode), d.shape, (target,),
                                  decode=target, dtype=dtype)
    return jobs


def _dense_sources(weight: str, decode: SourceDecode) -> tuple[str, ...]:
    """The source keys of a dense weight: itself, or (first) the keys its spec converter decodes it from."""
    if weight not in decode.dense:
        return (weight,)
    keys = decode.dense[weight][1].values()
    return tuple(sorted(keys, key=lambda k: (k != weight, k)))


def _expert_jobs(d: Decision, spec: ModelSpec, tensors: dict[str, TensorInfo], decode: SourceDecode,
                 parts_of: dict[str, set[str]]) -> list[_ModuleJob]:
    module, _, proj = d.name.rpartition(".*.")
    partners = next((g for g in spec.quant.shared_scale_groups if proj in g), (proj,))
    kind = "decode" if d.format is None else "nvfp4_cast" if d.packed and d.format.weights.casts_from_mxfp4 else "quant"
    amax = d.format.input_amax if d.format is not None else None
    jobs = []
    for e in d.experts:
        name = f"{module}.{e}.{proj}"
        stored = sorted(parts_of.get(name, ()))
        op = None if d.packed else decode.expert_op(set(stored))
        parts = (_PACKED, _SCALE) if d.packed else ("weight",) if op is None else (
            op.codes_field, op.scales_field, *(p for p in stored if p not in (op.codes_field, op.scales_field)))
        group = tuple(f"{module}.{e}.{p}" for p in partners if f"{module}.{e}.{p}.{parts[0]}" in tensors)
        jobs.append(_ModuleJob(name, kind, d.format, tuple(f"{name}.{t}" for t in parts), d.shape, group, amax,
                               decode=op))
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
