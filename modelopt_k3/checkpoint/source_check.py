"""One check of a checkpoint's tensors against its config, from headers alone, before any weight is read.

``load_pretrained`` and the streaming converter both call it, so they accept and refuse the same
checkpoints:

* **Routed experts** (``check_experts``): the config decides, through the model spec
  (``SourceCheckSpec.expert_layout``, model-specific code in ``models/<model>/``), which MoE layers exist,
  how many experts each has and the ``[out, in]`` of every projection. Every expert of every layer
  must store every projection, either MXFP4-packed (``weight_packed`` uint8 ``[out, in/2]`` +
  ``weight_scale`` uint8 E8M0 ``[out, in/32]``) or plain (a floating ``weight [out, in]``), one way
  for the whole checkpoint; nothing else may sit under an experts module.
* **Everything else** (``check_dense``): only the model knows its parameters. ``load_pretrained``
  builds it on the meta device anyway and passes its state; the converter does so only when asked
  (``--trust_remote_code``: building runs the checkpoint's code). Without the model, the converter
  checks the dense tensors against their own headers only (complete, in bounds), and says so.

All problems are collected and reported together, naming the tensors and the config fields.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..numerics.constants import MXFP4_BLOCK
from ..spec import CarriedModules, ExpertsLayout, ModelSpec
from .reader import CheckpointError

__all__ = ["SourceLayout", "SourceMismatchError", "check_carried", "check_dense", "check_experts"]

PACKED, SCALE, PLAIN = "weight_packed", "weight_scale", "weight"
FP8_SCALE = "weight_scale_inv"  # a block-FP8 expert's per-block scales beside its float8 ``weight``
_SHOWN = 12


class SourceMismatchError(CheckpointError):
    """The checkpoint's tensors disagree with its config (missing, unexpected or mis-shaped)."""


class TensorMeta(Protocol):
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class SourceLayout:
    packed_experts: bool  # routed experts stored MXFP4-packed
    expert_keys: frozenset[str]  # every routed-expert tensor of the checkpoint (outside carried modules)
    carried: CarriedModules | None = None  # modules no model builds, carried unquantized (``check_carried``)
    carried_keys: frozenset[str] = frozenset()  # every stored key under them


def _natural(key: str) -> list:
    """Sort key that orders ``experts.8`` before ``experts.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def _listing(label: str, items: list[str]) -> str:
    items = sorted(items, key=_natural)
    more = f" … and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return f"{len(items)} {label}: {', '.join(items[:_SHOWN])}{more}"


def _raise(what: str, missing: list[str], mismatched: list[str], unexpected: list[str], hint: str) -> None:
    parts = [_listing(label, items) for label, items in
             (("missing", missing), ("mis-shaped", mismatched), ("unexpected", unexpected)) if items]
    if parts:
        raise SourceMismatchError(f"{what}: {'; '.join(parts)}{hint}")


def _count_hint(layouts: dict[str, ExpertsLayout], stored: dict[str, set[int]]) -> str:
    """"every MoE layer stores experts 0-7" when that alone explains a num_experts disagreement."""
    if not layouts or set(stored) != set(layouts):
        return ""
    ids = {frozenset(v) for v in stored.values()}
    n = next(iter(layouts.values())).num_experts
    if len(ids) == 1 and (only := next(iter(ids))) == frozenset(range(len(only))) and len(only) != n:
        return f"config.json says num_experts={n} but every MoE layer stores experts 0-{len(only) - 1}; "
    return ""


def _want(kind: str, out_f: int, in_f: int, block: tuple[int, int] | None = None
          ) -> tuple[torch.dtype | None, tuple[int, int]]:
    """The dtype (None: any floating dtype) and shape of one expert tensor kind (``block``: the block-FP8 source's
    ``weight_block_size``)."""
    if kind == PACKED:
        return torch.uint8, (out_f, in_f // 2)
    if kind == SCALE:
        return torch.uint8, (out_f, in_f // MXFP4_BLOCK)
    if kind == FP8_SCALE and block is not None:
        return torch.float32, (-(-out_f // block[0]), -(-in_f // block[1]))
    return None, (out_f, in_f)


# transformers' quantization_config.quant_method of a block-FP8 checkpoint (a checkpoint's word, not one of our
# formats: those are compared only in quant/schemes.py).
BLOCK_FP8_QUANT_METHOD = "fp8"


def _fp8_block(config: Mapping[str, Any]) -> tuple[int, int] | None:
    """The declared block-FP8 ``weight_block_size`` (None: the config declares none)."""
    qcfg = config.get("quantization_config") or {}
    block = qcfg.get("weight_block_size") if qcfg.get("quant_method") == BLOCK_FP8_QUANT_METHOD else None
    return (int(block[0]), int(block[1])) if isinstance(block, list) and len(block) == 2 else None


def check_config(config: Mapping[str, Any], spec: ModelSpec) -> None:
    """Every config field the tools read, checked before any of them reads it (``spec.source_check.check_config``): a missing
    ``hidden_size`` is one line naming it, not a KeyError deep in the memory planner."""
    if spec.source_check.check_config is not None:
        spec.source_check.check_config(config)


def check_experts(tensors: Mapping[str, TensorMeta], config: Mapping[str, Any], spec: ModelSpec,
                  stored_name: Callable[[str], str] | None = None) -> SourceLayout:
    """Check every routed-expert tensor the config asks for against the checkpoint's headers.

    A spec without ``expert_layout`` gets no check (only packedness is read off the names). ``stored_name``
    (``CheckpointReader.stored_name``): the stored tensor a view's per-expert name is part of; a mis-shaped
    one is then named once by the stored tensor (what the user can find), not once per derived name.
    """
    key_re = re.compile(spec.experts.key_regex)
    carried_keys = check_carried(tensors, config, spec)  # checked on their own: no model builds them
    carried = spec.source_check.carried(config) if carried_keys else None
    expert_keys = {key for key in tensors if key_re.match(key) and key not in carried_keys}
    if spec.source_check.expert_layout is None:
        # MXFP4-packed: uint8 codes (INT4 pack-quantized codes are int32 and are decoded at load).
        packed = any(key_re.match(k)["tensor"] == PACKED and tensors[k].dtype == torch.uint8 for k in expert_keys)
        return SourceLayout(packed, frozenset(expert_keys), carried, carried_keys)
    layouts = {layout.module: layout for layout in spec.source_check.expert_layout(config)}
    unexpected: list[str] = []
    kinds: set[str] = set()
    stored: dict[str, set[int]] = {}
    block = _fp8_block(config)  # block-FP8 experts store a weight_scale_inv beside each float8 weight
    tensor_kinds = (PACKED, SCALE, PLAIN, FP8_SCALE) if block else (PACKED, SCALE, PLAIN)
    for key in sorted(expert_keys):
        m = key_re.match(key)
        stored.setdefault(m["module"], set()).add(int(m["expert"]))
        layout = layouts.get(m["module"])
        if layout is None:
            unexpected.append(f"{key} (config.json has no MoE layer {m['module']})")
        elif int(m["expert"]) >= layout.num_experts:
            unexpected.append(f"{key} (expert {m['expert']} >= num_experts={layout.num_experts})")
        elif m["proj"] not in layout.projections or m["tensor"] not in tensor_kinds:
            unexpected.append(f"{key} (not a {'/'.join(layout.projections)} {'/'.join(tensor_kinds)})")
        else:
            kinds.add("packed" if m["tensor"] in (PACKED, SCALE) else "plain")
    if len(kinds) > 1:
        raise SourceMismatchError("the checkpoint mixes MXFP4-packed and plain routed experts")
    packed = kinds == {"packed"} or (not kinds and bool(layouts))
    missing: list[str] = []
    mismatched: list[str] = []
    seen: set[str] = set()  # stored tensors already named as mis-shaped
    for layout in layouts.values():
        for proj, (out_f, in_f) in layout.projections.items():
            for kind in (PACKED, SCALE) if packed else (PLAIN, FP8_SCALE) if block else (PLAIN,):
                dtype, shape = _want(kind, out_f, in_f, block)
                for e in range(layout.num_experts):
                    key = f"{layout.module}.{e}.{proj}.{kind}"
                    meta = tensors.get(key)
                    if meta is None:
                        missing.append(key)
                    elif tuple(meta.shape) != shape or (meta.dtype != dtype if dtype else not meta.dtype.is_floating_point):
                        need = f"{dtype} {list(shape)}" if dtype else f"a floating dtype {list(shape)}"
                        stored = stored_name(key) if stored_name else key
                        if stored == key:
                            mismatched.append(f"{key} stored as {meta.dtype} {list(meta.shape)}, config needs {need}")
                        elif stored not in seen:
                            seen.add(stored)
                            mismatched.append(f"{stored} (per expert, as {key}: {meta.dtype} {list(meta.shape)}), "
                                              f"config needs {need} per expert")
    source = next(iter(layouts.values())).source if layouts else "no MoE layers"
    _raise(f"{_count_hint(layouts, stored)}the checkpoint's routed experts do not match config.json", missing,
           mismatched, unexpected, f" (config.json: {source})")
    return SourceLayout(packed, frozenset(expert_keys), carried, carried_keys)


def check_dense(
    expected: Mapping[str, torch.Tensor],
    tensors: Mapping[str, TensorMeta],
    skip: Iterable[str] = (),
    converted: Mapping[str, str | tuple[str, ...]] | None = None,
) -> None:
    """Check the model's dense state (``expected``: name -> its tensor, e.g. on meta) against the checkpoint.

    ``skip``: names not read from their own key (fused experts, filled from the expert tensors); tensors
    of ``tensors`` already accounted for (the routed experts) must be left out of it by the caller.
    ``converted``: names filled by a spec's dense converter from the stored key(s) given (its shape is the
    converter's to check, when it reads the value).
    """
    skip = set(skip)
    converted = {name: (keys,) if isinstance(keys, str) else tuple(keys) for name, keys in (converted or {}).items()}
    missing, mismatched = [], []
    for name, t in expected.items():
        if name in skip:
            continue
        if name in converted:
            missing += [key for key in converted[name] if key not in tensors]
            continue
        meta = tensors.get(name)
        if meta is None:
            missing.append(name)
        elif tuple(meta.shape) != tuple(t.shape) or meta.dtype.is_floating_point != t.dtype.is_floating_point:
            mismatched.append(f"{name} stored as {meta.dtype} {list(meta.shape)}, the model has {t.dtype} "
                              f"{list(t.shape)}")
    accounted = set(expected) | {key for keys in converted.values() for key in keys}
    unexpected = [name for name in tensors if name not in accounted]
    _raise("the checkpoint does not match the model built from config.json", missing, mismatched, unexpected,
           " (unexpected: tensors the model has no place for)" if unexpected else "")


def check_present(names: Iterable[str], tensors: Mapping[str, TensorMeta]) -> None:
    """Each of ``names`` is stored (tensors read by rows, e.g. a placed rank's expert biases, whose shapes are
    checked as their rows are read): a missing one is refused like a missing dense tensor."""
    _raise("the checkpoint does not match the model built from config.json", [n for n in names if n not in tensors],
           [], [], "")


def _stray_dense(tensors: Mapping[str, TensorMeta], declared: set[str], spec: ModelSpec) -> list[str]:
    """Stored keys neither declared dense nor a routed expert's (an exact ``dense_required``)."""
    expert_key = re.compile(spec.experts.key_regex)
    return [f"{key} (config.json implies no such tensor)" for key in tensors
            if key not in declared and not expert_key.match(key)]


def check_dense_against_config(tensors: Mapping[str, TensorMeta], config: Mapping[str, Any], spec: ModelSpec) -> None:
    """The dense tensors whose shapes config.json fixes (``spec.source_check.dense_layout``) and those every checkpoint
    of the config stores (``dense_required``), without building the model: the converter's check when it runs no
    remote code (``load_pretrained`` checks against the model itself)."""
    required = spec.source_check.dense_required
    declared = required(config) if required is not None else ()
    missing = [key for key in declared if key not in tensors]
    exact = required is not None and spec.source_check.dense_exact
    stray = _stray_dense(tensors, set(declared), spec) if exact else []
    if spec.source_check.dense_layout is None:
        _raise("the checkpoint lacks dense tensors config.json implies", missing, [], stray, "")
        return
    rules = [(re.compile(rx), shape, why) for rx, shape, why in spec.source_check.dense_layout(config)]
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    layers = text.get("num_hidden_layers")
    mismatched, unexpected = [], list(stray)
    for key, meta in tensors.items():
        for rx, shape, why in rules:
            m = rx.fullmatch(key) if shape is not None else rx.match(key)
            if m is None:
                continue
            if shape is None:
                if int(m["layer"]) >= layers and not exact:  # an exact declaration has named it already
                    unexpected.append(f"{key} (layer {m['layer']} >= num_hidden_layers={layers})")
            elif tuple(meta.shape) != shape:
                mismatched.append(f"{key} stored as {list(meta.shape)}, config.json needs {list(shape)} ({why})")
            break
    _raise("the checkpoint's dense tensors do not match config.json", missing, mismatched, unexpected, "")


# A Linear weight stored in a source format a spec decodes, by the parts beside (or instead of) ``weight``:
# block-FP8 (``weight`` float8 + ``weight_scale_inv``), INT4 pack-quantized (``weight_packed`` int32 ``[out, in/8]``
# + ``weight_scale`` + ``weight_shape``). -> the logical weight shape it decodes to.
def _logical_weight(parts: Mapping[str, TensorMeta]) -> tuple[tuple[int, ...] | None, set[str]]:
    """(the shape the stored weight decodes to, the parts that hold it), or (None, set()) for no stored weight."""
    weight = parts.get(PLAIN)
    if weight is not None and weight.dtype == torch.float8_e4m3fn and "weight_scale_inv" in parts:
        return tuple(weight.shape), {PLAIN, "weight_scale_inv"}
    packed = parts.get(PACKED)
    if packed is not None and packed.dtype == torch.int32 and len(packed.shape) == 2 and {SCALE, "weight_shape"} <= set(parts):
        return (packed.shape[0], packed.shape[1] * 8), {PACKED, SCALE, "weight_shape"}
    if weight is not None:
        return tuple(weight.shape), {PLAIN}
    return None, set()


def check_carried(tensors: Mapping[str, TensorMeta], config: Mapping[str, Any], spec: ModelSpec) -> frozenset[str]:
    """Every tensor the carried modules must hold (``CarriedModules.tensors``) is stored with its shape -- a weight
    plain or in a source format that decodes to it -- and nothing else sits under them; returns their stored keys.
    The loader and the converter both call it (the model, which does not build them, cannot check them)."""
    carried = spec.source_check.carried(config) if spec.source_check.carried is not None else None
    if carried is None:
        return frozenset()
    stored = {k: t for k, t in tensors.items() if carried.holds(k)}
    by_module: dict[str, dict[str, TensorMeta]] = {}
    for key, meta in stored.items():
        module, _, part = key.rpartition(".")
        by_module.setdefault(module, {})[part] = meta
    missing, mismatched, accounted = [], [], set()
    for name, shape in carried.tensors.items():
        module, _, part = name.rpartition(".")
        parts = by_module.get(module, {})
        if part == PLAIN and len(shape) == 2:
            got, holding = _logical_weight(parts)
            weight = parts.get(PLAIN)
            if weight is not None and weight.dtype == torch.float8_e4m3fn and "weight_scale_inv" not in parts:
                missing.append(f"{module}.weight_scale_inv")  # a float8 weight is nothing without its scales
                accounted.add(name)
                continue
        else:
            meta = parts.get(part)
            got, holding = (None, set()) if meta is None else (tuple(meta.shape), {part})
        if got is None:
            missing.append(name)
            continue
        accounted |= {f"{module}.{p}" for p in holding}
        if got != tuple(shape):
            mismatched.append(f"{name} stored as {list(got)}, config.json needs {list(shape)}")
    unexpected = [k for k in stored if k not in accounted]
    _raise(f"the checkpoint's {carried.reason} tensors ({', '.join(carried.prefixes)}) do not match config.json",
           missing, mismatched, unexpected, "")
    return frozenset(stored)
