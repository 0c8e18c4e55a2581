"""``load_pretrained``: config -> spec -> plan -> prepare -> build on meta -> read this rank's tensors.

The loader never calls ``from_pretrained``: that would either gather everything (no expert
parallelism on the plain path) or hand the MXFP4 experts to the compressed-tensors quantizer. It
uses the same pieces instead: the checkpoint's own classes (``auto_map``), built with accelerate's
``init_empty_weights(include_buffers=False)`` (parameters on meta, buffers computed for real), the
converters the spec registered with transformers' conversion API, and lazy ``safe_open`` reads of
exactly the persistent tensors this rank owns.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
from accelerate import init_empty_weights
from torch import nn
from tqdm.auto import tqdm
from transformers.core_model_loading import WeightConverter

from ..checkpoint import CheckpointReader, read_config
from ..checkpoint.nonfinite import source_refusal, warn_passthrough
from ..checkpoint.source_check import SourceLayout, check_dense, check_present
from ..checkpoint.source_decode import (
    SourceDecode,
    declared_shape_mismatch,
    decoded_dense,
    dense_decodes,
    plan_dense_conversions,
)
from ..dist.collectives import run_together
from ..dist.fsdp import check_partition, local_experts, local_rows, local_tensor, shard_model
from ..dist.group import current_group
from ..dist.placement import ExpertPlacement, Placement
from ..dist.plan import DistributionPlan, Residency
from ..experts.packed import DecodeWorkspace, ResidencyError, is_packed, to_packed
from ..numerics._slabs import run_slabs
from ..run.planning import check_library_source, library_config, plan_library_load
from ..spec import CarriedModules, ModelSpec, PrepareContext, get_spec
from ..spec.config import load_dtype
from ..spec.conversion import (
    decode_op,
    decodes_after_layout,
    layout_blocks,
    run_converter,
    run_converter_fields,
)
from ..spec.names import under_any

if TYPE_CHECKING:
    from ..run.plan import RunPlan

EXPERTS_PER_READ = 16


class LoadError(ValueError):
    """Missing, unexpected or mismatched tensors: the checkpoint disagrees with its config (user input, a
    ValueError); the message names them."""


@dataclass
class LoadInfo:
    """What the load did: the load stage's result beside the model (``Loaded``), taken by the quantize stage and,
    inside the ``QuantPlan``, by export and report; also left on the model as ``model.modelopt_k3`` for the
    library's ``quantize``."""

    checkpoint: Path
    spec: ModelSpec
    plan: DistributionPlan
    placement: Placement  # the run's mesh and expert placement (``DistributionPlan.build_placement``)
    model_cls: type | None = None  # the checkpoint's own class (before any FSDP2 wrapping)
    source_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    packed_experts: bool = False  # routed experts stored MXFP4-packed in the source
    # Dense names decoded from a source format at load -> the source keys they consumed (``decoded_dense``).
    decoded_dense: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Modules the checkpoint stores but the model does not build (``SourceCheckSpec.carried``: MTP layers), their
    # stored keys (never loaded) and how an export writes them (``checkpoint.source_decode.carried_items``).
    carried: CarriedModules | None = None
    carried_keys: frozenset[str] = frozenset()
    carried_decode: SourceDecode = field(default_factory=SourceDecode)
    carried_dtype: torch.dtype = torch.bfloat16  # the load's dtype: a carried dense weight decodes into it
    bytes_read: int = 0
    keys_read: list[str] = field(default_factory=list)
    # Source tensors with NaN/Inf (or NaN E8M0 scales) let through by allow_nonfinite_passthrough.
    nonfinite: dict[str, str] = field(default_factory=dict)
    # The plan the model was loaded through (``load_planned``; ``load_pretrained`` builds one): quantize takes
    # its decision table when none is given (``quant.api.planned_table``). None: assembled by hand (tests).
    run: RunPlan | None = field(default=None, repr=False)
    _source: CheckpointReader | None = field(default=None, repr=False)

    def source(self) -> CheckpointReader:
        """A reader over the source checkpoint for later reads (headers parsed once, kept open)."""
        if self._source is None:
            self._source = CheckpointReader(self.checkpoint)
        return self._source


def resolve_model_class(path: Path, raw: dict, trust_remote_code: bool,
                        spec: ModelSpec | None = None) -> tuple[type, object]:
    """The model class and its config, as the spec says it is obtained (``LoadingSpec.model_class``: the
    checkpoint's remote code, refused without ``trust_remote_code``, or a transformers class)."""
    spec = spec or get_spec(raw.get("model_type", ""))
    return spec.loading.model_class.resolve(path, raw, trust_remote_code)


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextmanager
def _sub_configs_in(config, dtype: torch.dtype):
    """A composite config's sub-configs (``text_config``, ``vision_config``) set to ``dtype`` while the model is
    built: transformers builds each sub-model in its own config's ``dtype`` (``_from_config``), which would
    override the load's default dtype for them (a Qwen3.5-MoE VLM loaded in fp32 kept its text model BF16).
    Restored after, so the config an export writes is the checkpoint's."""
    subs = [sub for key in getattr(config, "sub_configs", None) or {}
            if (sub := getattr(config, key, None)) is not None and hasattr(sub, "dtype")]
    old = [sub.dtype for sub in subs]
    for sub in subs:
        sub.dtype = dtype
    try:
        yield
    finally:
        for sub, was in zip(subs, old, strict=True):
            sub.dtype = was


def _plan_expert_reads(
    reader: CheckpointReader, spec: ModelSpec, converters: list, local: dict[str, range], keys=None
) -> tuple[dict[str, dict[str, dict[int, str]]], set[str]]:
    """target fused param -> source pattern -> {expert id: key}, for the experts in ``local[module]`` only
    (``keys``: the source keys to consider, default all).

    Returns the plan and the set of expert keys that belong to other ranks (neither read nor unexpected).
    """
    key_re = re.compile(spec.experts.key_regex)
    reads: dict[str, dict[str, dict[int, str]]] = defaultdict(lambda: defaultdict(dict))
    foreign: set[str] = set()
    for key in reader.names() if keys is None else keys:
        m = key_re.match(key)
        if m is None:
            continue
        mine = local.get(m["module"])
        expert = int(m["expert"])
        if mine is not None and expert not in mine:
            foreign.add(key)
            continue
        for conv in converters:
            target, pattern = conv.rename_source_key(key)
            if pattern is not None:
                slots = reads[target][pattern]
                if expert in slots:
                    raise LoadError(f"expert {expert} of {target} is stored twice: {slots[expert]} and {key}")
                slots[expert] = key
                break
    return reads, foreign


def _fill_experts(
    model: nn.Module,
    reader: CheckpointReader,
    spec: ModelSpec,
    converters: list,
    experts: dict[str, nn.Module],
    progress: tqdm,
    keys=None,
) -> tuple[set[str], set[str]]:
    """Fill every fused experts parameter of ``experts`` with this rank's experts (``keys``: the source keys
    that can hold them, default all); returns (keys read, targets filled)."""
    # Global ids this rank holds per module: its EP block, or the rows of its FSDP2 shard.
    ranges = {name: local_experts(module, spec) for name, module in experts.items()}
    reads, foreign = _plan_expert_reads(reader, spec, converters, ranges, keys)
    consumed: set[str] = set()
    filled: set[str] = set()
    for conv in converters:
        target_suffix = conv.target_patterns[0]
        param_name = target_suffix.rsplit(".", 1)[-1]
        for module_name, module in experts.items():
            target = f"{module_name}.{param_name}"
            if not target.endswith(target_suffix) or param_name not in spec.experts.sharded_params:
                continue
            by_pattern = reads.get(target, {})
            if not any(p in by_pattern for p in conv.source_patterns):
                continue
            consumed |= _fill_expert_param(model, reader, conv, module_name, module, param_name, by_pattern,
                                           ranges[module_name])
            filled.add(target)
            progress.update(1)
    consumed |= _fill_stored_fused(reader, spec, experts, ranges, filled, progress)
    return consumed | foreign, filled


def _fill_stored_fused(reader: CheckpointReader, spec: ModelSpec, experts: dict[str, nn.Module],
                       ranges: dict[str, range], filled: set[str], progress: tqdm) -> set[str]:
    """Fused expert parameters the checkpoint stores fused under their own name (e.g. GPT-OSS's expert
    biases ``[E, out]``): this rank's experts' rows only (a slice read, nothing gathered); adds to ``filled``."""
    consumed: set[str] = set()
    for module_name, module in experts.items():
        for param_name in spec.experts.sharded_params:
            key = f"{module_name}.{param_name}"
            if key in filled or key not in reader:
                continue
            local, rows = local_tensor(getattr(module, param_name)), ranges[module_name]
            stored = reader.info(key)
            if tuple(stored.shape[1:]) != tuple(local.shape[1:]) or len(rows) != local.shape[0]:
                raise LoadError(f"{key}: checkpoint shape {list(stored.shape)} does not hold this rank's "
                                f"{len(rows)} experts of shape {list(local.shape[1:])}")
            with torch.no_grad():
                local.copy_(reader.get_rows(key, rows.start, rows.stop).to(local.dtype))
            consumed.add(key)
            filled.add(key)
            progress.update(1)
    return consumed


def _fill_expert_param(model: nn.Module, reader: CheckpointReader, conv, module_name: str, module: nn.Module,
                       param_name: str, by_pattern: dict, local: range) -> set[str]:
    """Read, convert and copy experts ``local`` of fused parameter ``module_name.param_name``; returns the
    keys read."""
    target = f"{module_name}.{param_name}"
    missing = [
        _missing_key(module_name, e, p, by_pattern.get(p, {}))
        for p in conv.source_patterns
        for e in local
        if e not in by_pattern.get(p, {})
    ]
    if missing:
        raise LoadError(f"{target}: missing expert tensors {_names(missing)}")
    destinations = _expert_destinations(module, param_name, conv)
    for dest in destinations.values():
        if dest.shape[0] != len(local):
            raise LoadError(f"{target}: parameter holds {dest.shape[0]} experts, this rank owns {len(local)}")
    if not is_packed(module) and decodes_after_layout(conv):
        return _decode_experts_into(reader, conv, by_pattern, local, destinations[None], target)
    consumed: set[str] = set()
    # A few experts at a time: peak memory stays near the parameter itself, not 3x it.
    for start in range(0, len(local), EXPERTS_PER_READ):
        ids = local[start : start + EXPERTS_PER_READ]
        tensors = {p: [reader.get(by_pattern[p][e]) for e in ids] for p in conv.source_patterns}
        consumed.update(by_pattern[p][e] for p in conv.source_patterns for e in ids)
        if is_packed(module):
            converted = run_converter_fields(conv, tensors, full_layer_name=target, model=model)
        else:
            converted = {None: run_converter(conv, tensors, full_layer_name=target, model=model,
                                             dtype=destinations[None].dtype)}
        for kind, value in converted.items():
            rows = destinations[kind][start : start + len(ids)]
            _check_rows(target, value.shape, rows)
            with torch.no_grad():
                rows.copy_(value.to(rows.dtype))
    return consumed


def _check_rows(target: str, shape, rows: torch.Tensor) -> None:
    if tuple(shape) != tuple(rows.shape):
        raise LoadError(f"{target}: converted shape {list(shape)} != parameter rows {list(rows.shape)}")


@torch.no_grad()
def _decode_experts_into(reader: CheckpointReader, conv, by_pattern: dict, local: range, param: torch.Tensor,
                         target: str) -> set[str]:
    """Decode every source expert tensor straight into its region of ``param`` (this rank's rows).

    Where each source lands is worked out from shapes alone (``layout_blocks``: the chain's stacking and
    concatenation, followed as ``run_converter_fields`` runs them), so no stacked codes, concatenated codes
    or decoded intermediate is ever made: each read (the codes and scales, as stored) is decoded once, into
    the parameter. Returns the keys read.
    """
    op = decode_op(conv)
    codes_patterns = [p for p in conv.source_patterns if p.endswith(op.codes_field)]
    keys = {p: [by_pattern[p][e] for e in local] for p in codes_patterns}
    shapes = {p: [op.decoded_shape(reader.info(k).shape) for k in ks] for p, ks in keys.items()}
    try:
        shape, blocks = layout_blocks(conv, shapes)
    except ValueError as e:
        raise LoadError(f"{target}: {e}") from None
    _check_rows(target, shape, param)
    _check_declared_shapes(reader, op, by_pattern, local, shapes)
    # Expert by expert, as the shards store them (one expert's projections lie together).
    blocks = sorted(blocks, key=lambda b: (b.index, codes_patterns.index(b.pattern)))
    pairs = [(keys[b.pattern][b.index], by_pattern[op.scales_pattern(b.pattern)][local[b.index]]) for b in blocks]

    def decode_blocks(sl: slice) -> None:
        for block, (codes_key, scales_key) in zip(blocks[sl], pairs[sl]):
            codes, scales = reader.get(codes_key), reader.get(scales_key)
            rows = param[block.where].view(block.shape)
            if rows.is_contiguous():
                op.decode(codes, scales, param.dtype, out=rows)
            else:
                rows.copy_(op.decode(codes, scales, param.dtype))

    # Blocks spread over the numerics workers (each decodes whole blocks; a small expert is one slab, so
    # decoding them one by one from here would keep one worker busy at a time). A worker's error is raised here.
    run_slabs(len(blocks), math.prod(blocks[0].shape) if blocks else 0, param.device, decode_blocks)
    # Every source pattern's keys are consumed, also the ones the decode does not read (e.g. a weight_shape).
    return {by_pattern[p][e] for p in conv.source_patterns for e in local}


def _check_declared_shapes(reader: CheckpointReader, op, by_pattern: dict, local: range,
                           shapes: dict[str, list[tuple[int, ...]]]) -> None:
    """Each stored declared shape (``DecodeOp.shape_field``, e.g. INT4's ``weight_shape``) equals the shape its
    codes decode to (``declared_shape_mismatch``, the converter's check too): else refused, naming the tensor."""
    for pattern in shapes:
        for expert in local:
            why = declared_shape_mismatch(reader, op, by_pattern[pattern][expert])
            if why:
                raise LoadError(why)


def _expert_destinations(module: nn.Module, param: str, conv) -> dict[str | None, torch.Tensor]:
    """Where a converter's output goes: the fused parameter (this rank's rows), or for packed experts the
    codes and scales buffers, keyed by the checkpoint field the converter keeps for each."""
    if not is_packed(module):
        return {None: local_tensor(getattr(module, param))}
    op = decode_op(conv)
    if op is None:
        raise ResidencyError("packed experts need an MXFP4-packed source; this checkpoint stores its experts decoded")
    layout = module.packed_layouts[param]
    return {op.codes_field: getattr(module, layout.qdata_name), op.scales_field: getattr(module, layout.scale_name)}


def _missing_key(module_name: str, expert: int, pattern: str, present: dict[int, str]) -> str:
    """The key expert ``expert`` lacks, read off a sibling's key for the same pattern (else the pattern)."""
    for other, key in present.items():
        head = f"{module_name}.{other}."
        if key.startswith(head):
            return f"{module_name}.{expert}.{key[len(head) :]}"
    return f"{module_name}.{expert}.<{pattern}>"


def _names(keys: list[str] | set[str], limit: int = 12) -> str:
    keys = sorted(keys)
    more = f" … and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def persistent_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name: what a checkpoint holds (non-persistent buffers never are)."""
    state = dict(model.named_parameters())
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                state[f"{module_name}.{name}" if module_name else name] = buf
    return state


def _read_dense(name: str, tensor: torch.Tensor, reader: CheckpointReader, model: nn.Module, conversion) -> tuple[torch.Tensor, str]:
    """(this rank's part of the source value for ``name``, source key): rows of an FSDP2 shard only."""
    sharded = tensor is not local_tensor(tensor)
    rows = local_rows(tensor) if sharded else None
    if conversion is not None:
        conv, keys = conversion
        stored = {pattern: [reader.get(k)] for pattern, k in keys.items()}  # outside the try: a CheckpointError is a ValueError too
        key = keys.get(conv.source_patterns[0], next(iter(keys.values())))
        try:  # converters see the whole stored tensors (dense conversions are small: A_log, one FP8 Linear)
            value = run_converter(conv, stored, full_layer_name=name, model=model, dtype=tensor.dtype)
        except ValueError as e:
            raise LoadError(str(e)) from None
        if isinstance(value, list) and len(value) == 1:  # a chain of per-tensor ops keeps the one-element list
            value = value[0]
        if tuple(value.shape) != tuple(tensor.shape):
            raise LoadError(f"{name}: converted shape {list(value.shape)} != model shape {list(tensor.shape)}")
        return (value[rows.start : rows.stop] if sharded else value), key
    stored = reader.info(name)
    if stored.shape != tuple(tensor.shape):
        raise LoadError(f"{name}: checkpoint shape {list(stored.shape)} != model shape {list(tensor.shape)}")
    return (reader.get_rows(name, rows.start, rows.stop) if sharded else reader.get(name)), name


def _fill_dense(
    model: nn.Module, reader: CheckpointReader, skip: set[str], info: LoadInfo, progress: tqdm,
    scope: LoadScope | None = None,
) -> set[str]:
    """Copy every dense parameter and buffer (of ``scope``, default all) from its checkpoint tensor
    (``check_dense`` has matched them)."""
    consumed: set[str] = set()
    conversions = plan_dense_conversions(reader, info.spec.loading.dense_converters,
                                          None if scope is None else scope.keys)
    for name, tensor in persistent_tensors(model).items():
        if name in skip or (scope is not None and not scope.holds(name)):
            continue
        conversion = conversions.get(name)
        src, key = _read_dense(name, tensor, reader, model, conversion)
        info.source_dtypes[name] = reader.info(key).dtype
        with torch.no_grad():
            local_tensor(tensor).copy_(src.to(tensor.dtype))
        consumed.update(conversion[1].values() if conversion is not None else (key,))
        progress.update(1)
    return consumed


def _sharded_expert_params(model: nn.Module, spec: ModelSpec) -> tuple[set[str], set[str]]:
    """The experts' sharded parameters: (those filled from per-expert tensors, the projections, not read by
    their own name; the others, e.g. GPT-OSS's expert biases, stored fused under their own name)."""
    fused = {proj.fused_param for proj in spec.experts.projections}
    names = {(f"{name}.{p}", p in fused) for name in spec.experts_modules(model) for p in spec.experts.sharded_params}
    return {n for n, is_fused in names if is_fused}, {n for n, is_fused in names if not is_fused}


def _check_against_model(model: nn.Module, spec: ModelSpec, reader: CheckpointReader, source: SourceLayout) -> None:
    dense = {k: v for k, v in reader.headers().items() if k not in source.expert_keys and k not in source.carried_keys}
    converted = {name: tuple(keys.values())
                 for name, (_, keys) in plan_dense_conversions(reader, spec.loading.dense_converters).items()}
    fused, stored_fused = _sharded_expert_params(model, spec)
    # The stored-fused ones hold this rank's rows only (a placement): their shapes are checked as their rows
    # are read; here that each is stored at all (a missing expert bias is refused, not left unwritten).
    check_dense(persistent_tensors(model), dense, skip=fused | stored_fused, converted=converted)
    check_present(stored_fused, dense)


def _build_on_meta(
    model_cls: type, config, dtype: torch.dtype, reader: CheckpointReader, spec: ModelSpec,
    placement: ExpertPlacement | None = None,
) -> nn.Module:
    """The model with parameters on meta and, when a placement is given, only its experts (else all)."""
    # Parameters on meta, buffers for real: non-persistent buffers get what the modules' own __init__
    # computes (accelerate's helper; torch.device("meta") would leave them empty).
    with _default_dtype(dtype), _sub_configs_in(config, dtype), init_empty_weights(include_buffers=False):
        model = model_cls(config)
    if placement is not None:
        spec.experts.place_experts(model, placement)  # on the instances: another model in this process may differ
    _keep_source_dtypes_on_meta(model, reader, spec)  # before sharding: a DTensor's dtype is fixed
    tie_as_stored(model, reader)
    return model


def tie_as_stored(model: nn.Module, reader: CheckpointReader) -> None:
    """Tie what the config ties (``tie_word_embeddings``) as transformers' ``from_pretrained`` does: a tied
    parameter the checkpoint does not store (``lm_head.weight``) is its source's; one stored too stays its own.
    Called on meta and again after materialising (``to_empty`` gives each module a parameter of its own)."""
    tie = getattr(model, "tie_weights", None)
    if tie is None or not getattr(model, "get_expanded_tied_weights_keys", None):
        return
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tie(missing_keys={name for name in names if name not in reader})


def check_against_model(path: str | Path, source: SourceLayout) -> None:
    """Build the checkpoint's own model on the meta device and check every dense tensor's header against it.

    What ``load_pretrained`` does before reading; the streaming converter calls it whenever no untrusted code
    runs (a model on transformers' own classes, or ``trust_remote_code`` given). Prepares the spec with
    the whole-model placement (a process-wide patch, as a load does).
    """
    path = Path(path)
    raw = read_config(path)
    spec = get_spec(raw.get("model_type", ""))
    spec.check_transformers()
    spec.loading.build(path)
    model_cls, config = resolve_model_class(path, raw, trust_remote_code=True, spec=spec)
    spec.loading.prepare(PrepareContext(model_cls, config, path, packed_experts=source.packed_experts))
    with CheckpointReader(path) as reader:
        model = _build_on_meta(model_cls, config, load_dtype(config), reader, spec)
        _check_against_model(model, spec, reader, source)


def materialize(model: nn.Module, device: torch.device | str, scope: LoadScope | None = None) -> None:
    """``to_empty`` for the parameters built on meta (of the modules in ``scope``, default all); buffers
    built for real keep their values.

    ``to_empty`` replaces every tensor, buffers included, with uninitialised memory; the real buffers
    (non-persistent ones such as a sin-cos table, which no checkpoint holds) are copied back onto ``device``.
    """
    kept = {name: buf for name, buf in model.named_buffers() if not buf.is_meta}
    if scope is None:
        model.to_empty(device=device)
    else:
        for name, module in model.named_modules():
            if scope.holds(name):
                module.to_empty(device=device, recurse=False)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in kept and (scope is None or scope.holds(name)):
                buf.copy_(kept[name])


def _keep_source_dtypes_on_meta(model: nn.Module, reader: CheckpointReader, spec: ModelSpec) -> None:
    """Give ``spec.loading.keep_source_dtype`` parameters their checkpoint dtype while the model is still on meta."""
    if not spec.loading.keep_source_dtype:
        return
    keep = re.compile(spec.loading.keep_source_dtype)
    for name, param in list(model.named_parameters()):
        if keep.search(name) and name in reader and reader.info(name).dtype != param.dtype:
            owner, _, attr = name.rpartition(".")
            new = nn.Parameter(torch.empty_like(param, dtype=reader.info(name).dtype), param.requires_grad)
            setattr(model.get_submodule(owner), attr, new)


def set_experts_implementation(model: nn.Module, spec: ModelSpec, plan: DistributionPlan) -> None:
    """Route every fused experts module of ``model`` through the plan's experts implementation, with the
    plan's local implementation on the owner (``torch_a2a``) and, for packed experts, its decode chunk.

    Set on the configs the experts read at call time, after construction (see Kimi-K3's prepare).
    """
    for module in spec.experts_modules(model).values():
        module.config._experts_implementation = plan.experts_implementation
        module.local_experts_implementation = plan.local_experts_implementation
        if is_packed(module):
            module.decode_chunk = min(plan.decode_chunk or module.num_experts, module.num_experts)


def _pack_experts(model: nn.Module, spec: ModelSpec) -> DecodeWorkspace:
    """Give every fused experts module of a meta-built model the packed layout; one shared workspace."""
    workspace = DecodeWorkspace()
    for module in spec.experts_modules(model).values():
        to_packed(module, spec, workspace)
    return workspace


def load_pretrained(
    path: str | Path,
    *,
    plan: str = "auto",
    trust_remote_code: bool = False,
    dtype: torch.dtype | None = None,
    experts_implementation: str | None = None,
    ep_degree: int | None = None,
    dense: str = "replicated",
    experts: str = "auto",
    decode_chunk: int | None = None,
    progress: bool = True,
    allow_nonfinite_passthrough: bool = False,
) -> nn.Module:
    """Load a checkpoint with fused experts, sharded per the distribution plan.

    ``plan``: ``auto`` (expert_parallel under torchrun with more than one rank, else whole),
    ``whole``, ``expert_parallel`` or ``fsdp2`` (dense part and experts sharded with FSDP2
    ``fully_shard``; each rank reads only its rows, see ``dist/fsdp.py``). ``dtype`` defaults to the
    config's dtype. ``dense="fsdp2"`` with ``expert_parallel`` shards the dense part with FSDP2 too
    (experts stay expert-parallel). Every parameter is filled from the checkpoint or loading fails naming the tensors;
    nothing is left initialised at random. Before any weight is read, the checkpoint's headers are checked
    against config.json (``source_check``: the routed experts the config asks for) and against the model
    built on meta (every dense tensor). A tensor holding NaN/Inf (or an E8M0 NaN scale) is refused, naming it
    and the count, unless ``allow_nonfinite_passthrough`` (then ``quantize`` refuses to quantize it and the
    export copies it unchanged; ``LoadInfo.nonfinite`` lists them).

    ``experts``: ``bf16`` holds the routed experts decoded; ``packed`` (MXFP4-sourced checkpoints) holds
    their source bytes and decodes them inside the experts forward (``experts/packed.py``), one
    layer or ``decode_chunk`` experts at a time; ``auto`` is packed when the memory planner says the
    ``bf16`` residency does not fit this device (``memory/planner.py``), else bf16. Both give the same
    logits, calibration and export, bit for bit. ``experts_implementation`` names what runs the experts
    (under expert parallelism: what runs each owner's experts; the plan's default otherwise).

    Nothing is decided here: the arguments become a ``PtqConfig`` (``run.planning.library_config``: the model's
    default recipe, the planner's default calibration shape) and hf_ptq's own planning steps make its ``RunPlan``
    (``plan_library_load``: spec, reader, decision table, dtype, distribution plan, residency, memory fit --
    a load the planner says cannot fit is refused, ``MemoryPlanError``), which ``load_planned`` loads; the
    model keeps it (``model.modelopt_k3.run``) for ``quantize`` to take its table (decision 0016).
    """
    group = current_group()
    config = library_config(path, plan=plan, trust_remote_code=trust_remote_code, dtype=dtype, ep_degree=ep_degree,
                            dense=dense, experts=experts, allow_nonfinite_passthrough=allow_nonfinite_passthrough)
    # hf_ptq's planning steps on these arguments (no second way to decide). Every rank refuses the same input
    # here, before any collective: one agreed error, not one per rank.
    checked = run_together("load: check the checkpoint", check_library_source, config, group=group)
    run = plan_library_load(config, rank=group.rank, world_size=group.world_size, device=group.device,
                            experts_implementation=experts_implementation, decode_chunk=decode_chunk, checked=checked)
    return load_planned(run, progress=progress).model


class Loaded(NamedTuple):
    """The load stage's result: the model and what the load did (``LoadInfo``), which the quantize stage takes
    (``quant.api.quantize_planned``). The model keeps ``info`` too (``model.modelopt_k3``) for library calls."""

    model: nn.Module
    info: LoadInfo


def load_planned(run: RunPlan, *, progress: bool = True) -> Loaded:
    """``load_pretrained`` of a run the preflight planned (``RunPlan``, hf_ptq): its spec, its one reader of
    the source (headers read once), the experts' source layout and the distribution plan with its residency
    and decode chunk are taken as decided; only the model class is resolved here. The resident residency of
    ``build_planned`` + ``read_scope``: everything materialised, then read at once."""
    build = build_planned(run)
    return Loaded(_load_whole(build, progress, run.config.allow_nonfinite_passthrough), build.info)


@dataclass
class PlacedBuild:
    """A planned load up to its reads (stages 1-4): the placed model on meta, checked against the headers, with
    the reader, the spec's converters and the ``LoadInfo`` the reads fill. The one load path: a resident load
    materialises it all and reads everything (``load_planned``); a layerwise one (``LayerwiseLoad``) reads one
    ``LoadScope`` at a time (``read_scope``)."""

    model: nn.Module
    reader: CheckpointReader
    converters: list
    info: LoadInfo
    group: object  # the run's process group (``dist.group``): the reads are agreed steps over it

    def refuse_unconsumed(self, consumed: set[str]) -> None:
        """Source tensors no read consumed (carried modules aside: the export writes them) are refused."""
        unexpected = set(self.reader.names()) - consumed - self.info.carried_keys
        if unexpected:
            raise LoadError(f"checkpoint tensors the model has no place for: {_names(unexpected)}")


def build_planned(run: RunPlan) -> PlacedBuild:
    """Stages 1-4 of a run the preflight planned: the model class, the transformers dispatch, placement, the
    spec's prepare, the placed model on meta (nothing read, nothing materialised)."""
    group = current_group()
    src = run_together("load: check the checkpoint", _planned_source, run, group=group)
    _register_dispatch(run.distribution)
    build = _build(run.checkpoint, src, run.distribution, run.dtype, group)
    build.info.run = run  # quantize takes the plan's decision table from it (``quant.api.planned_table``)
    return build


def read_scope(build: PlacedBuild, scope: LoadScope | None, *, allow_nonfinite_passthrough: bool,
               progress: bool = True, what: str | None = None) -> set[str]:
    """Fill this rank's tensors of ``scope`` (materialised; None: the whole model, whose leftovers are then
    refused) from the checkpoint and record the reads; every rank agrees on the outcome. Returns the source
    keys consumed."""
    what = what or f"rank {build.info.plan.rank}"
    return run_together(f"load {what}" if scope is not None else "load checkpoint", _read_scope, build, scope,
                        allow_nonfinite_passthrough, progress, what, group=build.group)


def _read_scope(build: PlacedBuild, scope: LoadScope | None, allow_nonfinite_passthrough: bool, progress: bool,
                what: str) -> set[str]:
    model, reader, info = build.model, build.reader, build.info
    total = len([n for n in persistent_tensors(model) if scope is None or scope.holds(n)])
    with reader:
        with tqdm(total=total, desc=f"load {what}", disable=not progress, leave=False) as bar:
            consumed = _fill_own(model, reader, build.converters, info, bar, scope)
        if scope is None:
            build.refuse_unconsumed(consumed)
        _record_reads(info, reader, allow_nonfinite_passthrough, None if scope is None else scope.keys)
    return consumed


def _build(path: Path, src: _Source, the_plan: DistributionPlan, dtype: torch.dtype, group) -> PlacedBuild:
    """Stages 3-4 for a decided plan: placement, prepare, the placed model on meta, its ``LoadInfo``."""
    placement = the_plan.build_placement()  # the run's mesh and expert placement: built here, passed on
    converters = _prepare(src, path, the_plan)
    model = _build_placed_on_meta(src, the_plan, placement, dtype, group)
    info = LoadInfo(checkpoint=path, spec=src.spec, plan=the_plan, placement=placement, model_cls=src.model_cls,
                    packed_experts=src.layout.packed_experts, _source=src.reader,
                    **carried_fields(src.layout, src.reader, src.spec, converters, src.config, dtype))
    return PlacedBuild(model, src.reader, converters, info, group)


def _load_whole(build: PlacedBuild, progress: bool, allow_nonfinite_passthrough: bool) -> nn.Module:
    """Stage 5, resident: the whole placed model materialised on the plan's device, this rank's tensors read."""
    model, info = build.model, build.info
    materialize(model, info.plan.device)
    tie_as_stored(model, build.reader)
    # A rank whose own tensors are missing or wrong makes every rank fail here, naming it, instead of
    # its peers waiting in the first all-to-all until the timeout.
    read_scope(build, None, allow_nonfinite_passthrough=allow_nonfinite_passthrough, progress=progress)
    if info.plan.fsdp_sharded:
        check_partition(model)  # every element of every sharded parameter held (and so filled) by one rank
    model.eval()
    model.modelopt_k3 = info
    return model


def carried_fields(layout: SourceLayout, reader: CheckpointReader, spec: ModelSpec, converters: list,
                   config: object, dtype: torch.dtype) -> dict:
    """``LoadInfo``'s carried fields: the carried modules (as the source check found them) and how their stored
    tensors decode -- the spec's dense converters on their keys and its experts chains' decode steps."""
    if not layout.carried_keys:
        return {}
    ops = tuple(op for op in (decode_op(c) for c in converters if isinstance(c, WeightConverter)) if op is not None)
    decode = SourceDecode(dense_decodes(reader, spec.loading.dense_converters, sorted(layout.carried_keys)),
                          () if layout.packed_experts else ops, config)
    return {"carried": layout.carried, "carried_keys": layout.carried_keys, "carried_decode": decode,
            "carried_dtype": dtype}


@dataclass(frozen=True)
class _Source:
    """What ``_open_source`` found: the checkpoint's spec, reader, experts layout, model class and config."""

    spec: ModelSpec
    reader: CheckpointReader
    layout: SourceLayout
    model_cls: type
    config: object


def _planned_source(run: RunPlan) -> _Source:
    """Stage 1 of a planned run: the preflight checked the headers against config.json; the model class."""
    spec = run.spec
    spec.check_transformers()
    spec.loading.build(run.checkpoint)
    model_cls, config = resolve_model_class(run.checkpoint, run.raw_config, run.trust_remote_code, spec)
    return _Source(spec, run.reader, run.source, model_cls, config)


def _register_dispatch(plan: DistributionPlan) -> None:
    """An expert-parallel plan routes tokens through ``torch_a2a``: registered with transformers before use."""
    if plan.expert_parallel:
        from ..experts.dispatch import register_torch_a2a

        register_torch_a2a()


def _prepare(src: _Source, path: Path, plan: DistributionPlan) -> list:
    """Stage 3: the spec patches the checkpoint's classes; returns the spec's checkpoint converters."""
    ctx = PrepareContext(src.model_cls, src.config, path, plan.experts_implementation,
                         packed_experts=src.layout.packed_experts)
    src.spec.loading.prepare(ctx)
    return src.spec.loading.converters(ctx)


def _build_placed_on_meta(
    src: _Source, plan: DistributionPlan, placement: Placement, dtype: torch.dtype, group
) -> nn.Module:
    """The model on meta with this rank's experts, checked against the headers, laid out per the plan
    (packed, FSDP2-sharded over the placement's mesh), its experts routed through the plan's implementation."""
    spec = src.spec
    model = _build_on_meta(src.model_cls, src.config, dtype, src.reader, spec, placement.experts)
    run_together("load: check the checkpoint against the model", _check_against_model, model, spec, src.reader,
                 src.layout, group=group)
    if plan.experts_residency is Residency.PACKED:
        _pack_experts(model, spec)  # before sharding and materializing: only the codes are ever allocated
    if plan.fsdp_sharded:
        shard_model(model, placement.fsdp_mesh, spec, shard_experts=not plan.expert_parallel)
    set_experts_implementation(model, spec, plan)
    return model


def _fill_own(model: nn.Module, reader: CheckpointReader, converters: list, info: LoadInfo, bar: tqdm,
              scope: LoadScope | None = None) -> set[str]:
    """Fill this rank's experts and dense tensors (of ``scope``, default all); refuse a fused expert parameter
    no source fills; returns the source keys consumed."""
    spec = info.spec
    experts = {n: m for n, m in spec.experts_modules(model).items() if scope is None or scope.holds(n)}
    consumed_experts, filled = _fill_experts(model, reader, spec, converters, experts, bar,
                                             None if scope is None else scope.keys)
    unfilled = [f"{n}.{p}" for n in experts for p in spec.experts.sharded_params if f"{n}.{p}" not in filled]
    if unfilled:
        raise LoadError(f"fused expert parameters with no checkpoint source: {_names(unfilled)}")
    return consumed_experts | _fill_dense(model, reader, filled | _packed_fields(experts), info, bar, scope)


def _record_reads(info: LoadInfo, reader: CheckpointReader, allow_nonfinite_passthrough: bool,
                  keys: tuple[str, ...] | None = None) -> None:
    """After a read (of ``keys``' part, default all): bytes and keys read, the dense names decoded at load,
    and the non-finite source tensors, refused unless passed through (each warned about once)."""
    info.bytes_read, info.keys_read = reader.log.bytes, list(reader.log.keys)
    decoded = decoded_dense(reader, info.spec.loading.dense_converters, keys)
    info.decoded_dense.update((k, v) for k, v in decoded.items() if not set(v) & info.carried_keys)
    if reader.log.invalid and not allow_nonfinite_passthrough:
        raise source_refusal(reader.log.invalid)
    new = {k: v for k, v in reader.log.invalid.items() if k not in info.nonfinite}
    warn_passthrough(new)
    info.nonfinite.update(new)


def _packed_fields(experts: dict[str, nn.Module]) -> set[str]:
    """Names of the packed experts' codes and scales buffers (filled with the experts, not as dense tensors)."""
    return {f"{n}.{name}" for n, m in experts.items() if is_packed(m)
            for lay in m.packed_layouts.values() for name in (lay.qdata_name, lay.scale_name)}


@dataclass(frozen=True)
class LoadScope:
    """The part of a model one layerwise read fills: module and tensor names under ``inside`` and not under
    ``outside``, and the source keys that can hold them (None: all)."""

    inside: tuple[str, ...]
    outside: tuple[str, ...] = ()
    keys: tuple[str, ...] | None = None

    def holds(self, name: str) -> bool:
        return under_any(name, self.inside) and not under_any(name, self.outside)
