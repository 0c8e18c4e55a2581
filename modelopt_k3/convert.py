"""Calibration-free streaming conversion: an MXFP4 Kimi-K3-class checkpoint -> a ModelOpt checkpoint.

``convert_checkpoint(src, dst, recipe)`` never builds the model. It reads the source index and the
safetensors headers, decides every tensor by its checkpoint name through the recipe, and then
streams one source shard at a time into one output shard of the same file name:

- routed experts (``<experts>.{e}.w{1,2,3}.weight_packed/weight_scale`` pairs, one module each)
  with an NVFP4 format: the lossless MXFP4 -> NVFP4 cast (``numerics.mxfp4_to_nvfp4``); blocks that
  cannot carry over are requantized and counted; ``input_scale`` is the recipe's constant
  ``input_amax / (6 * 448)``;
- Linears the recipe gives ``fp8_pb``: 128x128 block FP8, weight only. A dimension that is not a
  multiple of 128 (KDA ``b_proj`` ``[num_heads, D]``) gets a partial edge block with its own
  amax-derived scale (``numerics.fp8``), so ``weight_scale`` is ``[ceil(out/128), ceil(in/128)]``;
- every other tensor is copied byte for byte (same name, dtype and bytes).

The tensors and configs equal, byte for byte, what the model path (``load_pretrained`` ->
``quantize`` -> ``export_checkpoint``) exports for the same recipe: it casts MXFP4-sourced experts the
same way (``quant/mxfp4_source.py``) and both write through ``export/modelopt_format.py``.

Decisions:

- **w1/w3 pairs across shards.** An expert's ``w1`` and ``w3`` share ``weight_scale_2``. The shared
  power-of-two scale depends only on both E8M0 ``weight_scale`` tensors (1/16 of the packed size),
  so the shard that holds ``w1`` reads ``w3.weight_scale`` wherever it is stored (and vice versa).
  Both sides compute the same value independently: shards stay whole, mirror the source one to one,
  and no rank waits for another.
- **Module tensors split across shards.** A module's output tensors go to the shard holding its
  main tensor (``weight_packed`` or ``weight``); its other source tensors are read from wherever
  they are.
- **Which 2-D weights are Linears** is decided from the checkpoint alone (the model is not built):
  a module whose tensors are a 2-D float ``weight`` and optionally ``bias``, or an MXFP4
  ``weight_packed``/``weight_scale`` pair, and whose name is not an embedding's. Modules with other
  tensors (the router's ``e_score_correction_bias``) are not Linears. This reproduces the model
  path's ``type(module) is nn.Linear`` for Kimi-K3 (tested against it).
- **Output layout.** The header is written first (output shapes are known from the source headers),
  tensors follow sorted by element size then production order (so every tensor is aligned), each
  written in place as it is produced: memory holds a few modules (one per worker thread), not a
  shard. Copied tensors move in the kernel (``copy_file_range``) where the filesystem allows.
- **Overlap.** Worker threads convert one shard's tensors; a finisher thread fsyncs, hashes, renames
  and records shard k while shard k + 1 is converted. Output bytes do not depend on the threads.
- **Reads** use ``pread`` rather than ``safe_open``: an mmap keeps every page it touched resident
  for the life of the handle, which would put a whole source shard into the process RSS.

Resume protocol (``dst`` is written in place so that a run can resume):

1. ``.modelopt_k3_convert/job.json`` identifies the job (a digest of the recipe and the source
   headers); a directory holding another job, or foreign files, is refused without ``overwrite``.
2. Each shard is written to ``.<name>.partial``, fsynced and renamed to ``<name>``; then its record
   ``.modelopt_k3_convert/shards/<name>.json`` (sizes, sha256 of the output file, its tensors and
   counters) is written (temporary file + rename). A rerun skips a shard whose record matches the
   job and whose file still has the recorded size and sha256, and redoes every other shard.
3. The finalize step (rank 0 after a barrier when a process group is initialised; otherwise
   whichever rank finds every record in place when it finishes, or ``finalize_conversion``)
   checks every record, writes the index, ``config.json``, ``hf_quant_config.json``, the remote
   code and tokenizer files, and last the marker ``.modelopt_k3_complete``. A complete directory is
   refused without ``overwrite``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import struct
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from . import __version__
from .checkpoint import _ST_DTYPES, INDEX_NAME, SINGLE_NAME, CheckpointError, read_header
from .export.modelopt_format import (
    config_quantization_config,
    hf_quant_config,
    input_scale_tensor,
    linear_layout,
    strip_source_quantization,
    weight_tensors,
)
from .export.writer import write_index
from .models.spec import ModelSpec, get_spec
from .numerics import fp8 as fp8n
from .numerics import nvfp4 as nvn
from .numerics.constants import MXFP4_BLOCK, NVFP4_BLOCK
from .numerics.convert import mxfp4_to_nvfp4, shared_global_scale_for
from .numerics.mxfp4 import mxfp4_decode
from .recipe import QuantFormat, Recipe, RecipeError, load_recipe

__all__ = [
    "COMPLETE_MARKER",
    "STATE_DIR",
    "ConvertError",
    "ConvertReport",
    "ConvertStats",
    "convert_checkpoint",
    "finalize_conversion",
]

STATE_DIR = ".modelopt_k3_convert"
COMPLETE_MARKER = ".modelopt_k3_complete"
JOB_FILE = "job.json"
RECORD_VERSION = 1
# Written by finalize (or never copied): everything else in the source directory that is not a
# safetensors shard (remote code, tokenizer, generation config) is copied as it is.
_NOT_SIDE_FILES = {INDEX_NAME, SINGLE_NAME, "config.json", "hf_quant_config.json"}
_EMBEDDING_RE = re.compile(r"(^|\.)(embed_tokens|embed_in|tok_embeddings|word_embeddings|wte|wpe|embeddings)$")
_ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}
_PACKED, _SCALE = "weight_packed", "weight_scale"
_COPY_CHUNK = 64 * 2**20
_HAS_COPY_FILE_RANGE = hasattr(os, "copy_file_range")
_HASH_CHUNK = 16 * 2**20


class ConvertError(RuntimeError):
    """The output directory or a shard's state refuses the conversion; the message names the file."""


# --------------------------------------------------------------------------- report


@dataclass
class ConvertStats:
    """Counters of converted shards. ``tensors``: source tensors by what became of them
    (``NVFP4``, ``FP8_PB_WO``, ..., ``copied``, ``decoded``); ``modules``: quantized Linears by algo.
    Expert blocks are NVFP4 blocks of 16 produced from MXFP4."""

    shards: int = 0
    tensors: Counter = field(default_factory=Counter)
    modules: Counter = field(default_factory=Counter)
    bytes_in: int = 0
    bytes_out: int = 0
    expert_blocks_lossless: int = 0
    expert_blocks_requantized: int = 0

    def add(self, other: ConvertStats) -> None:
        self.shards += other.shards
        self.tensors.update(other.tensors)
        self.modules.update(other.modules)
        self.bytes_in += other.bytes_in
        self.bytes_out += other.bytes_out
        self.expert_blocks_lossless += other.expert_blocks_lossless
        self.expert_blocks_requantized += other.expert_blocks_requantized

    def to_dict(self) -> dict:
        return {
            "shards": self.shards,
            "tensors": dict(sorted(self.tensors.items())),
            "modules": dict(sorted(self.modules.items())),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "expert_blocks_lossless": self.expert_blocks_lossless,
            "expert_blocks_requantized": self.expert_blocks_requantized,
        }

    @classmethod
    def from_dict(cls, d: dict) -> ConvertStats:
        return cls(
            shards=int(d["shards"]),
            tensors=Counter(d["tensors"]),
            modules=Counter(d["modules"]),
            bytes_in=int(d["bytes_in"]),
            bytes_out=int(d["bytes_out"]),
            expert_blocks_lossless=int(d["expert_blocks_lossless"]),
            expert_blocks_requantized=int(d["expert_blocks_requantized"]),
        )

    def lines(self, indent: str = "  ") -> list[str]:
        out = [f"{indent}source tensors by output format:"]
        for what, n in sorted(self.tensors.items()):
            mods = f"  ({self.modules[what]} modules)" if self.modules.get(what) else ""
            out.append(f"{indent}  {what:<12} {n:>9}{mods}")
        blocks = self.expert_blocks_lossless + self.expert_blocks_requantized
        if blocks:
            out.append(
                f"{indent}routed-expert NVFP4 blocks: {self.expert_blocks_lossless} lossless (MXFP4 codes "
                f"carried over), {self.expert_blocks_requantized} requantized"
            )
        out.append(f"{indent}bytes: {_mib(self.bytes_in)} in, {_mib(self.bytes_out)} out ({self.shards} shards)")
        return out


@dataclass
class ConvertReport:
    """What one ``convert_checkpoint`` call did. ``stats`` covers this rank's shards (converted now
    or found complete); ``total`` covers every shard once the output is complete."""

    src: Path
    dst: Path
    recipe: str
    rank: int
    world_size: int
    shards_total: int
    converted: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    stats: ConvertStats = field(default_factory=ConvertStats)
    total: ConvertStats | None = None
    complete: bool = False
    finalized: bool = False
    wall_s: float = 0.0

    def summary(self) -> str:
        lines = [
            f"modelopt_k3 convert: {self.src} -> {self.dst} (recipe {self.recipe}), rank {self.rank} of {self.world_size}",
            f"  shards: {self.shards_total} in the checkpoint; this rank converted {len(self.converted)}, "
            f"found {len(self.skipped)} already complete",
        ]
        lines += self.stats.lines("  ")
        rate = self.stats.bytes_in / self.wall_s if self.wall_s > 0 else 0.0
        lines.append(f"  time: {self.wall_s:.2f} s ({_mib(rate)}/s of source read)")
        if self.complete and self.total is not None:
            who = "finalized by this call" if self.finalized else "already finalized"
            lines.append(f"  output complete ({who}); all shards:")
            lines += self.total.lines("    ")
        else:
            lines.append(
                f"  output not complete yet: {len(self.pending)} shard(s) of other ranks pending; the rank that "
                "finishes last finalizes (or run finalize_conversion / --finalize)"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


# --------------------------------------------------------------------------- source scan


class _SrcTensor(NamedTuple):
    key: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def _raw_header(path: Path) -> bytes:
    """The length prefix and JSON header bytes of a shard (``read_header`` has validated them)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return struct.pack("<Q", n) + f.read(n)


def _scan_source(src: Path) -> tuple[list[str], dict[str, _SrcTensor], dict[str, int], str]:
    """(shard files, key -> tensor, file -> size, digest of all headers). Errors name the file."""
    if not src.is_dir():
        raise CheckpointError(f"source checkpoint directory {src} does not exist")
    index_path = src / INDEX_NAME
    weight_map: dict[str, str] | None = None
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not a mapping")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path} is not a valid safetensors index: {e}") from None
        files = sorted(set(weight_map.values()))
    elif (src / SINGLE_NAME).exists():
        files = [SINGLE_NAME]
    else:
        raise CheckpointError(f"{src} has neither {INDEX_NAME} nor {SINGLE_NAME}")

    listed_in: dict[str, set[str]] = {}
    for key, file in (weight_map or {}).items():
        listed_in.setdefault(file, set()).add(key)
    tensors: dict[str, _SrcTensor] = {}
    sizes: dict[str, int] = {}
    digest = hashlib.sha256()
    for file in files:
        path = src / file
        header = read_header(path)  # names the file when it is missing or its header is corrupt
        size = path.stat().st_size
        raw = _raw_header(path)
        data_start = len(raw)
        sizes[file] = size
        digest.update(f"{file}\0{size}\0".encode())
        digest.update(raw)
        listed = listed_in.get(file, set()) if weight_map is not None else None
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            if listed is not None and key not in listed:
                owner = weight_map.get(key)
                where = f"maps it to {owner}" if owner else "does not list it"
                raise CheckpointError(f"{path}: holds tensor {key}, but {INDEX_NAME} {where}")
            try:
                dtype = _ST_DTYPES.get(meta["dtype"])
                shape = tuple(int(d) for d in meta["shape"])
                begin, end = (int(x) for x in meta["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{path}: header entry of tensor {key} is malformed: {meta!r} ({e})") from None
            if dtype is None:
                raise CheckpointError(f"{path}: tensor {key} has unsupported dtype {meta['dtype']!r}")
            want = math.prod(shape) * dtype.itemsize
            if end - begin != want or begin < 0:
                raise CheckpointError(
                    f"{path}: header/size mismatch for tensor {key}: {meta['dtype']} {list(shape)} is {want} "
                    f"bytes but its data_offsets [{begin}, {end}] span {end - begin}"
                )
            if data_start + end > size:
                raise CheckpointError(
                    f"{path} is truncated: tensor {key} ends at byte {data_start + end} but the file has {size} bytes"
                )
            tensors[key] = _SrcTensor(key, file, dtype, shape, data_start + begin, end - begin)
        if listed is not None:
            absent = sorted(listed - set(header))
            if absent:
                raise CheckpointError(
                    f"{path}: {INDEX_NAME} lists {len(absent)} tensor(s) that this shard's header lacks, "
                    f"e.g. {absent[0]}"
                )
    return files, tensors, sizes, digest.hexdigest()


class _SourceFiles:
    """Positional reads from source shards (no mmap, so nothing stays resident in this process)."""

    def __init__(self, src: Path, tensors: dict[str, _SrcTensor]):
        self.src = src
        self.tensors = tensors
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, file: str) -> int:
        with self._lock:
            if file not in self._fds:
                try:
                    self._fds[file] = os.open(self.src / file, os.O_RDONLY)
                except FileNotFoundError:
                    raise CheckpointError(f"checkpoint shard {self.src / file} is missing") from None
            return self._fds[file]

    def read(self, key: str) -> torch.Tensor:
        t = self.tensors[key]
        buf = torch.empty(t.nbytes, dtype=torch.uint8)
        if t.nbytes:
            _pread_into(self.fd(t.file), memoryview(buf.numpy()), t.offset, self.src / t.file)
        return buf.view(t.dtype).reshape(t.shape)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CheckpointError(f"{path} is truncated: read stopped at byte {offset + done}")
        done += n


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


# --------------------------------------------------------------------------- plan


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
    if not config_path.is_file():
        raise CheckpointError(f"{src} has no config.json")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path} is not valid JSON: {e}") from None
    spec = get_spec(raw.get("model_type", ""))
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
    )


# --------------------------------------------------------------------------- one shard


class _ShardConverter:
    """Produces the output tensors of one module job (with a per-shard cache of shared scales)."""

    def __init__(self, plan: _Plan, reader: _SourceFiles):
        self.plan = plan
        self.reader = reader
        self._group_scale: dict[tuple[str, ...], torch.Tensor] = {}

    def _weight(self, job: _ModuleJob) -> torch.Tensor:
        """The logical weight in the model's dtype (MXFP4 decoded exactly, as the model path loads it)."""
        if len(job.sources) == 2:
            return mxfp4_decode(self.reader.read(job.sources[0]), self.reader.read(job.sources[1]), dtype=self.plan.dtype)
        return self.reader.read(job.sources[0]).to(self.plan.dtype)

    def _shared_scale(self, job: _ModuleJob, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``weight_scale_2`` (NVFP4) or ``weight_scale`` (FP8) shared by ``job.group``.

        Partners are read from whichever shard holds them: only their E8M0 scales for the lossless
        cast, the whole (decoded) weight for an amax-derived scale.
        """
        if job.group in self._group_scale:
            return self._group_scale[job.group]
        members = [self.plan.modules[m] for m in job.group]
        if job.kind == "nvfp4_cast":
            scale = shared_global_scale_for(*(self.reader.read(m.sources[1]) for m in members))
        else:
            amaxes = [
                (weight if m is job and weight is not None else self._weight(m)).float().abs().amax() for m in members
            ]
            amax = torch.stack(amaxes).amax()
            scale = nvn.nvfp4_global_scale(amax) if job.fmt.weights == "nvfp4" else fp8n.fp8_scale(amax)
        self._group_scale[job.group] = scale
        return scale

    def tensors(self, job: _ModuleJob) -> tuple[dict[str, torch.Tensor], ConvertStats]:
        """The job's output tensors (planned names) and its counters."""
        stats = ConvertStats()
        n_src = len(job.sources)
        if job.kind == "decode":
            stats.tensors["decoded"] += n_src
            # The model path writes a left-BF16 routed expert as bf16 whatever the model dtype.
            return {f"{job.name}.weight": self._weight(job).to(torch.bfloat16)}, stats
        fmt = job.fmt
        stats.tensors[fmt.algo] += n_src
        stats.modules[fmt.algo] += 1
        if job.kind == "nvfp4_cast":
            q, n_req = mxfp4_to_nvfp4(
                self.reader.read(job.sources[0]), self.reader.read(job.sources[1]), self._shared_scale(job)
            )
            blocks = job.shape[0] * job.shape[1] // NVFP4_BLOCK
            stats.expert_blocks_requantized += n_req
            stats.expert_blocks_lossless += blocks - n_req
            out = {
                f"{job.name}.weight": q.packed,
                f"{job.name}.weight_scale": q.block_scale,
                f"{job.name}.weight_scale_2": q.global_scale.reshape(()).to(torch.float32),
            }
        else:
            weight = self._weight(job)
            scale = None if fmt.weights == "fp8_pb" else self._shared_scale(job, weight)
            out = {f"{job.name}.{k}": v for k, v in weight_tensors(fmt.weights, weight, scale).items()}
        if fmt.inputs is not None:
            # As the model path's constant-amax input quantizer: an fp32 amax buffer -> its scale.
            amax = torch.full((), fmt.input_amax, dtype=torch.float32)
            scale = nvn.nvfp4_global_scale(amax) if fmt.inputs == "nvfp4" else fp8n.fp8_scale(amax)
            out[f"{job.name}.input_scale"] = input_scale_tensor(scale)
        return out, stats


def _layout(outputs: list[_Out]) -> tuple[bytes, dict[str, int]]:
    """Safetensors header bytes (length prefix included) and each tensor's absolute file offset.

    Tensors are laid out by element size (largest first), then production order, so every tensor
    starts at a multiple of its element size, as safetensors' own writer does.
    """
    order = sorted(range(len(outputs)), key=lambda i: (-outputs[i].dtype.itemsize, i))
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    rel: dict[str, int] = {}
    pos = 0
    for i in order:
        o = outputs[i]
        header[o.name] = {"dtype": _ST_NAMES[o.dtype], "shape": list(o.shape), "data_offsets": [pos, pos + o.nbytes]}
        rel[o.name] = pos
        pos += o.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {name: start + off for name, off in rel.items()}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _tensor_bytes(t: torch.Tensor):
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy() if t.numel() else b""


def _write_shard(
    plan: _Plan, file: str, dst: Path, reader: _SourceFiles, pool: ThreadPoolExecutor | None,
    on_item: Callable[[], None],
) -> tuple[Path, dict]:
    """Write source shard ``file`` into ``dst/.<file>.partial``; return it and its record (no sha256 yet).

    Jobs (copies and modules) run on ``pool`` when given; each writes its own byte ranges.
    """
    stats = ConvertStats(shards=1, bytes_in=plan.sizes[file])
    outputs: list[_Out] = []
    for job in plan.jobs[file]:
        if isinstance(job, str):
            t = plan.tensors[job]
            outputs.append(_Out(job, t.dtype, t.shape))
        else:
            outputs.extend(job.outputs)
    header, offsets = _layout(outputs)
    total = len(header) + sum(o.nbytes for o in outputs)
    expected = {o.name: o for o in outputs}
    tmp = dst / f".{file}.partial"
    converter = _ShardConverter(plan, reader)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def run(job: str | _ModuleJob) -> ConvertStats:
        if isinstance(job, str):
            _copy_range(reader, plan.tensors[job], fd, offsets[job])
            done = ConvertStats()
            done.tensors["copied"] += 1
            return done
        out, done = converter.tensors(job)
        for name, tensor in out.items():
            want = expected[name]
            if tensor.dtype != want.dtype or tuple(tensor.shape) != want.shape:
                raise AssertionError(
                    f"{name}: produced {tensor.dtype} {list(tensor.shape)}, planned {want.dtype} {list(want.shape)}"
                )
            _pwrite_all(fd, _tensor_bytes(tensor), offsets[name])
        return done

    try:
        _pwrite_all(fd, header, 0)
        os.ftruncate(fd, total)
        if pool is None:
            for job in plan.jobs[file]:
                stats.add(run(job))
                on_item()
        else:
            futures = [pool.submit(run, job) for job in plan.jobs[file]]
            try:
                for fut in futures:
                    stats.add(fut.result())
                    on_item()
            except BaseException:
                for fut in futures:
                    fut.cancel()
                wait(futures)  # no job may still write once fd is closed
                raise
    finally:
        os.close(fd)
    stats.bytes_out = total
    record = {
        "version": RECORD_VERSION,
        "fingerprint": plan.fingerprint,
        "source": {"file": file, "size": plan.sizes[file]},
        "output": {"file": file, "size": total, "sha256": None},
        "tensors": sorted(expected),
        "tensor_bytes": sum(o.nbytes for o in outputs),
        "stats": stats.to_dict(),
    }
    return tmp, record


def _finish_shard(tmp: Path, dst: Path, record: dict) -> dict:
    """fsync and hash the written shard, rename it into place, then save its completion record."""
    file = record["output"]["file"]
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    record["output"]["sha256"] = _sha256(tmp)
    os.replace(tmp, dst / file)
    dir_fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename is durable before the record claims it
    finally:
        os.close(dir_fd)
    _write_json_atomic(_record_path(dst, file), record)
    return record


def _copy_range(reader: _SourceFiles, t: _SrcTensor, out_fd: int, out_offset: int) -> None:
    """Copy one tensor's bytes: in the kernel (``copy_file_range``) where it can, else pread/pwrite."""
    src_fd = reader.fd(t.file)
    done = 0
    if _HAS_COPY_FILE_RANGE:
        try:
            while done < t.nbytes:
                n = os.copy_file_range(src_fd, out_fd, t.nbytes - done, t.offset + done, out_offset + done)
                if n == 0:
                    raise CheckpointError(
                        f"{reader.src / t.file} is truncated: read stopped at byte {t.offset + done}"
                    )
                done += n
            return
        except OSError:  # EXDEV, ENOSYS, EINVAL on some filesystems: finish with plain reads
            pass
    while done < t.nbytes:
        n = min(_COPY_CHUNK, t.nbytes - done)
        chunk = os.pread(src_fd, n, t.offset + done)
        if not chunk:
            raise CheckpointError(f"{reader.src / t.file} is truncated: read stopped at byte {t.offset + done}")
        _pwrite_all(out_fd, chunk, out_offset + done)
        done += len(chunk)


# --------------------------------------------------------------------------- state files


def _tmp_name(path: Path) -> Path:
    # Unique per writer: ranks on different hosts may share a pid and write to one shared filesystem.
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = _tmp_name(path)
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _record_path(dst: Path, file: str) -> Path:
    return dst / STATE_DIR / "shards" / f"{file}.json"


def _load_record(dst: Path, file: str, fingerprint: str, *, verify_hash: bool) -> dict | None:
    """The shard's record if it belongs to this job and its output file still matches it."""
    path = _record_path(dst, file)
    try:
        rec = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if rec.get("version") != RECORD_VERSION or rec.get("fingerprint") != fingerprint:
        return None
    out = dst / file
    try:
        if out.stat().st_size != rec["output"]["size"]:
            return None
    except FileNotFoundError:
        return None
    if verify_hash and _sha256(out) != rec["output"]["sha256"]:
        return None
    return rec


def _prepare_dst(dst: Path, plan: _Plan, recipe: Recipe, *, overwrite: bool) -> None:
    """Create or adopt ``dst``; refuse a complete output, another job's output or foreign files.

    Only idempotent steps, so that independent ranks may all run it.
    """
    state = dst / STATE_DIR
    if dst.exists() and not dst.is_dir():
        raise ConvertError(f"output path {dst} exists and is not a directory")
    marker = dst / COMPLETE_MARKER
    if marker.exists():
        if not overwrite:
            raise FileExistsError(
                f"{dst} already holds a complete conversion ({COMPLETE_MARKER}); pass overwrite=True "
                "(--overwrite) to convert again, or choose another output directory"
            )
        marker.unlink(missing_ok=True)
        (dst / INDEX_NAME).unlink(missing_ok=True)
    elif dst.is_dir() and not state.is_dir() and any(dst.iterdir()) and not overwrite:
        raise FileExistsError(
            f"output directory {dst} is not empty and holds no modelopt_k3 conversion; pass overwrite=True "
            "(--overwrite) to write into it anyway, or choose another output directory"
        )
    (state / "shards").mkdir(parents=True, exist_ok=True)
    job = {
        "fingerprint": plan.fingerprint,
        "src": str(plan.src),
        "recipe": recipe.name,
        "shards": plan.files,
    }
    job_path = state / JOB_FILE
    try:
        old = json.loads(job_path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        old = None
    if old is not None and old.get("fingerprint") != plan.fingerprint and not overwrite:
        raise ConvertError(
            f"{dst} holds a partial conversion of another job (source {old.get('src')}, recipe "
            f"{old.get('recipe')}); pass overwrite=True (--overwrite) to replace it, or choose another output directory"
        )
    if old != job:
        _write_json_atomic(job_path, job)


def _copy_file_atomic(src: Path, dst: Path) -> None:
    tmp = _tmp_name(dst)
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def _finalize(plan: _Plan, dst: Path, recipe: Recipe) -> ConvertStats:
    """Check every shard's record, then write index, configs, side files and (last) the marker."""
    records = {f: _load_record(dst, f, plan.fingerprint, verify_hash=False) for f in plan.files}
    missing = [f for f, rec in records.items() if rec is None]
    if missing:
        raise ConvertError(
            f"cannot finalize {dst}: {len(missing)} of {len(plan.files)} shard(s) are not complete, "
            f"e.g. {missing[0]}; run the ranks that own them (a rerun resumes)"
        )
    weight_map = {key: f for f, rec in records.items() for key in rec["tensors"]}
    total_bytes = sum(rec["tensor_bytes"] for rec in records.values())
    write_index(dst, [weight_map], total_bytes, rename=False)

    hf_quant = hf_quant_config(
        plan.layer_algos, kv_cache=recipe.kv_cache, exclude_modules=sorted(plan.left_bf16), recipe=recipe.name
    )
    config = strip_source_quantization(json.loads((plan.src / "config.json").read_text()))
    config["quantization_config"] = config_quantization_config(hf_quant)
    _write_json_atomic(dst / "config.json", config)
    _write_json_atomic(dst / "hf_quant_config.json", hf_quant)
    for path in sorted(plan.src.iterdir()):
        if path.is_file() and path.name not in _NOT_SIDE_FILES and not path.name.endswith(".safetensors"):
            _copy_file_atomic(path, dst / path.name)
    # Shards of an earlier job that are not part of this output (another source's file names).
    keep = set(plan.files)
    for path in dst.glob("*.safetensors"):
        if path.name not in keep:
            path.unlink(missing_ok=True)
    for path in dst.glob(".*.safetensors.partial"):
        path.unlink(missing_ok=True)

    total = ConvertStats()
    for rec in records.values():
        total.add(ConvertStats.from_dict(rec["stats"]))
    _write_json_atomic(
        dst / COMPLETE_MARKER,
        {
            "producer": {"name": "modelopt_k3", "version": __version__},
            "fingerprint": plan.fingerprint,
            "recipe": recipe.name,
            "src": str(plan.src),
            "shards": {f: rec["output"] for f, rec in records.items()},
            "stats": total.to_dict(),
        },
    )
    return total


# --------------------------------------------------------------------------- entry points


def _as_recipe(recipe: Recipe | str | Path) -> Recipe:
    return recipe if isinstance(recipe, Recipe) else load_recipe(recipe)


def _process_group(rank: int, world_size: int):
    """The run group when torch.distributed is initialised for exactly this rank/world, else None."""
    import torch.distributed as dist

    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    from .dist.group import current_group

    g = current_group()
    if (g.rank, g.world_size) != (rank, world_size):
        raise ValueError(
            f"rank={rank}, world_size={world_size} disagree with the initialised process group "
            f"(rank {g.rank} of {g.world_size})"
        )
    return g


def _complete_stats(dst: Path, fingerprint: str) -> ConvertStats | None:
    try:
        marker = json.loads((dst / COMPLETE_MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return ConvertStats.from_dict(marker["stats"]) if marker.get("fingerprint") == fingerprint else None


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    recipe: Recipe | str | Path,
    *,
    rank: int = 0,
    world_size: int = 1,
    resume: bool = True,
    overwrite: bool = False,
    verify: bool = True,
    workers: int | None = None,
    progress: bool = False,
) -> ConvertReport:
    """Convert ``src`` into the ModelOpt checkpoint ``dst`` per ``recipe``, shard by shard.

    This rank converts source shards ``i`` with ``i % world_size == rank`` (sorted file names).
    ``resume``: skip shards whose completion record validates (``verify``: also re-hash the output
    file); ``overwrite``: accept an existing complete output, another job's partial output or
    foreign files in ``dst``, and rewrite this rank's shards. ``workers``: threads converting one
    shard's tensors (default ``min(4, cpu count)``; the output bytes do not depend on it); torch's
    intra-op thread count is set to 1 while they run and restored afterwards.

    When ``torch.distributed`` is initialised the ranks meet in collectives and rank 0 finalizes;
    otherwise the rank that finds every shard complete when it finishes finalizes. Raises
    ``CheckpointError`` (naming the file) for a missing, truncated or inconsistent source shard,
    ``RecipeError`` for a recipe that needs calibration, ``FileExistsError``/``ConvertError`` for an
    output directory it must not write into.
    """
    t0 = time.perf_counter()
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    workers = min(4, os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    src, dst = Path(src).absolute(), Path(dst).absolute()
    if dst.resolve() == src.resolve():
        raise ValueError(f"the output directory must differ from the source checkpoint ({src})")
    recipe = _as_recipe(recipe)
    group = _process_group(rank, world_size)
    if group is not None:
        from .dist.collectives import run_together

        def together(step: str, fn: Callable, *args, **kwargs):
            return run_together(f"convert: {step}", fn, *args, group=group, **kwargs)
    else:

        def together(step: str, fn: Callable, *args, **kwargs):
            return fn(*args, **kwargs)

    plan = together("plan", _build_plan, src, recipe)
    report = ConvertReport(src, dst, recipe.name, rank, world_size, len(plan.files))
    if group is None or rank == 0:
        together("prepare output", _prepare_dst, dst, plan, recipe, overwrite=overwrite)
    else:
        together("prepare output", lambda: None)

    mine = plan.files[rank::world_size]

    def convert_mine() -> None:
        reader = _SourceFiles(src, plan.tensors)
        bar = _progress_bar(sum(len(plan.jobs[f]) for f in mine), rank, progress)
        pool = ThreadPoolExecutor(workers, thread_name_prefix="convert") if workers > 1 else None
        # Shard k is fsynced, hashed, renamed and recorded while shard k + 1 is converted.
        finisher = ThreadPoolExecutor(1, thread_name_prefix="convert-finish")
        pending: list[tuple[str, Future]] = []

        def collect() -> None:
            while pending:
                file, fut = pending.pop(0)
                rec = fut.result()
                report.converted.append(file)
                report.stats.add(ConvertStats.from_dict(rec["stats"]))

        try:
            for file in mine:
                if resume and not overwrite:
                    rec = _load_record(dst, file, plan.fingerprint, verify_hash=verify)
                    if rec is not None:
                        report.skipped.append(file)
                        report.stats.add(ConvertStats.from_dict(rec["stats"]))
                        bar.update(len(plan.jobs[file]))
                        continue
                _record_path(dst, file).unlink(missing_ok=True)
                tmp, rec = _write_shard(plan, file, dst, reader, pool, lambda: bar.update(1))
                collect()
                pending.append((file, finisher.submit(_finish_shard, tmp, dst, rec)))
            collect()
        finally:
            wait([fut for _, fut in pending])  # a shard written before a failure still gets its record
            finisher.shutdown()
            if pool is not None:
                pool.shutdown(cancel_futures=True)
            bar.close()
            reader.close()

    # Parallelism is across modules (``workers``); torch's own intra-op threads only spin on these
    # per-module tensors (measured: 4x the CPU time with 2 intra-op threads on 2 cores).
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        together("convert shards", convert_mine)
    finally:
        torch.set_num_threads(torch_threads)

    def finalize_if_ready() -> None:
        if group is not None and rank != 0:
            return
        pending = [f for f in plan.files if _load_record(dst, f, plan.fingerprint, verify_hash=False) is None]
        report.pending = pending
        if pending:
            return
        report.total = _finalize(plan, dst, recipe)
        report.complete = report.finalized = True

    together("finalize", finalize_if_ready)
    if not report.complete:
        total = _complete_stats(dst, plan.fingerprint)  # another rank (or process) finished it
        if total is not None:
            report.total, report.complete, report.pending = total, True, []
    report.wall_s = time.perf_counter() - t0
    return report


def finalize_conversion(src: str | Path, dst: str | Path, recipe: Recipe | str | Path) -> ConvertStats:
    """Write index, configs, side files and the completion marker once every shard is complete.

    Idempotent; ``convert_checkpoint`` calls it on its own when it finds every shard complete.
    Raises ``ConvertError`` naming a shard that is not complete.
    """
    src, dst = Path(src).absolute(), Path(dst).absolute()
    recipe = _as_recipe(recipe)
    plan = _build_plan(src, recipe)
    if not (dst / STATE_DIR / JOB_FILE).is_file():
        raise ConvertError(f"{dst} holds no modelopt_k3 conversion ({STATE_DIR}/{JOB_FILE} is missing)")
    return _finalize(plan, dst, recipe)


def _progress_bar(total: int, rank: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"convert rank {rank}", disable=not enabled, leave=False)
