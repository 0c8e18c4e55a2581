"""Decoding a source format without the model, as the loader decodes it (block-FP8 Linears, INT4 routed experts):
the spec's own converters, run on tensors read by name. The streaming converter decodes what it converts this
way, and both paths decode the tensors of carried modules (``spec.CarriedModules``: DeepSeek-V3's MTP layers,
which no model builds) this way, so both write the same bytes."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..spec.conversion import DecodeOp, decode_op, run_converter
from .reader import CheckpointError, CheckpointReader


class _ModelConfig:
    """What a spec's conversion op reads of the model it loads into: its config (``weight_block_size``)."""

    def __init__(self, config: Any) -> None:
        self.config = config


@dataclass(frozen=True)
class SourceDecode:
    """How the model path decodes a source format it loads decoded (block-FP8 Linears, INT4 experts): the
    spec's own converters, run here the same way, so both paths see the same weights.

    ``dense``: dense names a spec dense converter decodes (``dense_decodes``) -> (converter, {source pattern:
    key}); ``experts``: the decode steps of the spec's experts chains (``LoadingSpec.converters``) for routed
    experts stored encoded but not MXFP4-packed (those take the lossless cast); ``config``: the model's config,
    which the ops read."""

    dense: dict[str, tuple[Any, dict[str, str]]] = field(default_factory=dict)
    experts: tuple[DecodeOp, ...] = ()
    config: Any = None

    def expert_op(self, parts: set[str]) -> DecodeOp | None:
        """The decode step for a routed expert stored as ``parts`` (None: stored plain)."""
        return next((op for op in self.experts if {op.codes_field, op.scales_field} <= parts), None)

    def dense_weight(self, name: str, read, dtype: torch.dtype) -> torch.Tensor:
        """Dense ``name`` decoded as the load decodes it (the spec's converter, then the parameter's dtype)."""
        conv, keys = self.dense[name]
        value = run_converter(conv, {p: [read(k)] for p, k in keys.items()}, full_layer_name=name,
                              model=_ModelConfig(self.config), dtype=dtype)
        if isinstance(value, list) and len(value) == 1:  # a chain of per-tensor ops keeps the one-element list
            value = value[0]
        return value.to(dtype)


def declared_shape_mismatch(reader: CheckpointReader, op: DecodeOp, codes_key: str) -> str | None:
    """Why the shape ``codes_key``'s format declares beside it (``DecodeOp.shape_field``: INT4's
    ``weight_shape``) disagrees with the shape the codes decode to, or None (agreeing, or no declaration).
    The load and the converter both ask this, so neither takes a checkpoint the other refuses."""
    shape_key = op.shape_pattern(codes_key)
    if shape_key is None or shape_key not in reader:
        return None
    declared, decoded = reader.get(shape_key), op.decoded_shape(tuple(reader.info(codes_key).shape))
    if declared.numel() == len(decoded) and declared.tolist() == list(decoded):
        return None
    return f"{shape_key} declares shape {declared.tolist()}, but {codes_key} {list(reader.info(codes_key).shape)} decodes to {list(decoded)}"


def carried_items(keys: Iterable[str], decode: SourceDecode, expert_re: re.Pattern) -> dict[str, tuple[str, tuple[str, ...]]]:
    """What an export writes for the stored ``keys`` of carried modules: output name -> (how, source keys).
    ``"dense"``: a weight the spec's dense converter decodes (``SourceDecode.dense_weight``, the model's dtype, as a
    kept dense Linear); ``"expert"``: a routed expert Linear stored encoded (its decode step, then BF16, as a
    routed expert left unquantized); ``"copy"``: every other tensor, as stored. Every key is a source of one item."""
    keys = set(keys)
    items: dict[str, tuple[str, tuple[str, ...]]] = {}
    for name in sorted(decode.dense):
        sources = tuple(sorted(decode.dense[name][1].values()))
        if set(sources) <= keys:
            items[name] = ("dense", sources)
    parts: dict[str, set[str]] = {}
    for key in keys:
        if expert_re.match(key):
            module, _, part = key.rpartition(".")
            parts.setdefault(module, set()).add(part)
    for module, stored in sorted(parts.items()):
        op = decode.expert_op(stored)
        if op is not None:
            rest = sorted(stored - {op.codes_field, op.scales_field})
            items[f"{module}.weight"] = ("expert", tuple(f"{module}.{p}" for p in (op.codes_field, op.scales_field, *rest)))
    used = {k for _, sources in items.values() for k in sources}
    items.update((key, ("copy", (key,))) for key in sorted(keys - used))
    return dict(sorted(items.items()))


def carried_value(name: str, item: tuple[str, tuple[str, ...]], decode: SourceDecode,
                  read: Callable[[str], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The tensor an export writes for carried item ``name`` (``carried_items``); ``dtype``: the model's."""
    how, sources = item
    if how == "dense":
        return decode.dense_weight(name, read, dtype)
    if how == "expert":
        op = decode.expert_op({k.rpartition(".")[2] for k in sources})
        return op.decode(read(sources[0]), read(sources[1]), dtype).to(torch.bfloat16)
    return read(sources[0])


# ---------------------------------------------------------------- which dense tensors a spec converter decodes


def plan_dense_conversions(reader: CheckpointReader, converters: tuple,
                           keys=None) -> dict[str, tuple[object, dict[str, str]]]:
    """target name -> (converter, {source pattern: source key}) for the dense tensors a spec converter takes
    (one key, or several, e.g. a block-FP8 ``weight`` and its ``weight_scale_inv``); ``keys``: default all."""
    plan: dict[str, tuple[object, dict[str, str]]] = {}
    for key in reader.names() if keys is None else keys:
        for conv in converters:
            target, pattern = conv.rename_source_key(key)
            if pattern is not None:
                sources = plan.setdefault(target, (conv, {}))[1]
                if pattern in sources:
                    raise CheckpointError(f"{target}: two checkpoint tensors for one source: {sources[pattern]} and {key}")
                sources[pattern] = key
                break
    return plan


def dense_decodes(reader: CheckpointReader, converters: tuple, keys=None) -> dict[str, tuple[object, dict[str, str]]]:
    """``decoded_dense`` with the converter of each: target name -> (converter, {source pattern: source key}),
    as the load runs it (``run_converter``); the streaming converter decodes those tensors the same way."""
    plan = plan_dense_conversions(reader, converters, keys)
    return {target: (conv, k) for target, (conv, k) in plan.items() if decode_op(conv) is not None and len(k) > 1}


def decoded_dense(reader: CheckpointReader, converters: tuple, keys=None) -> dict[str, tuple[str, ...]]:
    """Dense names whose value a spec converter decodes from a source format (a ``DecodeOp`` chain), with
    the source keys they consume (among ``keys``, default all): the export writes them from the model, never
    by copying those keys."""
    return {target: tuple(sorted(k.values())) for target, (_, k) in dense_decodes(reader, converters, keys).items()}
