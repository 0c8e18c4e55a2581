"""The one reader of safetensors checkpoint directories: headers checked up front, tensors on request.

``CheckpointReader`` parses and checks every shard header when it is built (no tensor bytes are
read): the index and the shards agree tensor for tensor, every dtype is known, every tensor's
``data_offsets`` span exactly its dtype and shape, and no tensor ends past the end of its file.
Errors name the file and the tensor. It also fingerprints the headers (``header_digest``), which the
streaming converter's resume protocol keys on.

Two ways to read tensor bytes, both through the same checked headers:

- ``get`` / ``get_rows``: ``safe_open`` (memory-mapped; a row range reads only those rows), for the
  loader and the export, which read a rank's share of tensors once;
- ``pread`` / ``pread_into``: positional reads from plain file descriptors, for the streaming
  converter. It reads every byte of a checkpoint that may be far larger than RAM, and an mmap keeps
  every page it touched resident for the life of the handle.

Every tensor read is recorded (key and bytes) in a ``ReadLog``, so tests and benchmarks can prove
that an expert-parallel rank never touches another rank's experts, and checked for values that are
not numbers (``nonfinite.invalid_values``: one reduction over the bytes just read), recorded in
``log.invalid`` for the caller to act on. Only safetensors is ever read: no pickle.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import threading
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# safetensors dtype names (the header's "dtype") -> torch dtypes; the writer uses the inverse.
SAFETENSORS_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(ValueError):
    """The checkpoint directory is missing files or inconsistent; the message names the file/key."""


class TensorInfo(NamedTuple):  # a NamedTuple: a Kimi-K3 checkpoint has ~10**5 tensors
    """One tensor's header entry, checked against its file."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # absolute byte offset of the tensor's data in ``file``


def read_config(path: Path) -> dict:
    """A checkpoint directory's ``config.json``, parsed (no remote code runs); errors name the file."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{path} has no config.json; is it a checkpoint directory?")
    try:
        return json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config} is not valid JSON: {e}") from None


# --------------------------------------------------------------------------- headers


def _read_index(path: Path) -> dict[str, str]:
    """``weight_map`` of a safetensors index file: tensor name -> shard file name."""
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise TypeError("weight_map is not a mapping of tensor names to file names")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is not a valid safetensors index: {e}") from None
    return weight_map


def _read_raw_header(path: Path) -> tuple[bytes, dict, int]:
    """(length prefix + JSON header bytes, the parsed header, file size) of one safetensors file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            (n,) = struct.unpack("<Q", f.read(8))
            if 8 + n > size:
                raise ValueError(f"the header claims {n} bytes but the file has {size}")
            text = f.read(n)
        header = json.loads(text)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint shard {path} is missing") from None
    except (struct.error, ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"checkpoint shard {path} has a corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"checkpoint shard {path} has a corrupt safetensors header: not a JSON object")
    return struct.pack("<Q", n) + text, header, size


def read_header(path: Path) -> dict:
    """The parsed JSON header of one safetensors file (no tensor bytes are read); errors name the file."""
    return _read_raw_header(Path(path))[1]


class ShardHeader(NamedTuple):
    raw: bytes  # length prefix + JSON header, as stored
    header: dict  # the parsed JSON header
    tensors: dict[str, TensorInfo]  # every tensor's checked entry, header order
    size: int  # file size in bytes


def read_shard(path: Path, file: str | None = None) -> ShardHeader:
    """One safetensors file's header with every tensor entry checked (dtype, offsets vs shape, inside
    the file); ``file`` is the name entries carry (default: the file's name)."""
    path = Path(path)
    raw, header, size = _read_raw_header(path)
    tensors = {
        key: _tensor_info(path, file or path.name, key, meta, len(raw), size)
        for key, meta in header.items() if key != "__metadata__"
    }
    return ShardHeader(raw, header, tensors, size)


def _tensor_info(path: Path, file: str, key: str, meta: object, data_start: int, size: int) -> TensorInfo:
    """One header entry, checked: known dtype, offsets spanning exactly dtype x shape, inside the file."""
    try:
        dtype = SAFETENSORS_DTYPES.get(meta["dtype"])
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
    return TensorInfo(file, dtype, shape, end - begin, data_start + begin)


def _check_listed(path: Path, header: dict, listed: set[str], weight_map: Mapping[str, str]) -> None:
    """The index and this shard's header name the same tensors."""
    for key in header:
        if key != "__metadata__" and key not in listed:
            owner = weight_map.get(key)
            where = f"maps it to {owner}" if owner else "does not list it"
            raise CheckpointError(f"{path}: holds tensor {key}, but {INDEX_NAME} {where}")
    absent = sorted(listed - set(header))
    if absent:
        raise CheckpointError(
            f"{path}: {INDEX_NAME} lists {len(absent)} tensor(s) that this shard's header lacks, e.g. {absent[0]}"
        )


# --------------------------------------------------------------------------- reads


@dataclass
class ReadLog:
    """Every tensor read (key, bytes) and what in it is not a number. Thread-safe: converter workers share one."""

    keys: list[str] = field(default_factory=list)
    bytes: int = 0
    invalid: dict[str, str] = field(default_factory=dict)  # key -> what is not a number in it
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, key: str, tensor: torch.Tensor, nbytes: int, check_values: bool) -> None:
        found = None
        if check_values:
            from .nonfinite import invalid_values

            found = invalid_values(key, tensor)
        with self._lock:
            self.keys.append(key)
            self.bytes += nbytes
            if found is not None:
                self.invalid[key] = found


class CheckpointReader:
    """Key -> tensor access over ``model.safetensors.index.json`` (or a single ``model.safetensors``).

    Headers are parsed and checked on construction; file handles open on the first read of a file
    and close with ``close()`` (or the ``with`` block), after which they reopen on demand.
    """

    def __init__(self, path: str | Path, *, check_values: bool = True) -> None:
        self.path = Path(path)
        self.check_values = check_values
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        self.log = ReadLog()
        self.files: list[str] = []  # shard file names, sorted
        self.sizes: dict[str, int] = {}  # shard file -> size in bytes
        self._infos: dict[str, TensorInfo] = {}
        self.header_digest = self._scan()
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _scan(self) -> str:
        """Read and check every shard header; return the sha256 of every (file name, size, header)."""
        index = self.path / INDEX_NAME
        if index.exists():
            weight_map: dict[str, str] | None = _read_index(index)
            self.files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE_NAME).exists():
            weight_map, self.files = None, [SINGLE_NAME]
        else:
            raise CheckpointError(f"{self.path} has neither {INDEX_NAME} nor {SINGLE_NAME}")
        listed_in: dict[str, set[str]] = {file: set() for file in self.files}
        for key, file in (weight_map or {}).items():
            listed_in[file].add(key)
        digest = hashlib.sha256()
        for file in self.files:
            shard = read_shard(self.path / file, file)
            if weight_map is not None:
                _check_listed(self.path / file, shard.header, listed_in[file], weight_map)
            self.sizes[file] = shard.size
            self._infos.update(shard.tensors)
            digest.update(f"{file}\0{shard.size}\0".encode())
            digest.update(shard.raw)
        return digest.hexdigest()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._stack.close()
            self._handles.clear()
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    # ----------------------------------------------------------------- headers

    def names(self) -> Iterator[str]:
        """Every tensor name in the checkpoint (header order, shard by shard)."""
        return iter(self._infos)

    def headers(self) -> Mapping[str, TensorInfo]:
        """Every tensor's header entry by name (read-only; no tensor bytes are read)."""
        return MappingProxyType(self._infos)

    def __contains__(self, key: str) -> bool:
        return key in self._infos

    def inventory(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """(dtype, shape) of every tensor, by name: what the decision table is built from."""
        return {key: (info.dtype, info.shape) for key, info in self._infos.items()}

    def info(self, key: str) -> TensorInfo:
        try:
            return self._infos[key]
        except KeyError:
            raise CheckpointError(f"tensor {key!r} is not in checkpoint {self.path}") from None

    # ----------------------------------------------------------------- safe_open reads (loader, export)

    def _handle(self, file: str):
        with self._lock:
            if file not in self._handles:
                self._handles[file] = self._stack.enter_context(safe_open(self.path / file, framework="pt"))
            return self._handles[file]

    def get(self, key: str) -> torch.Tensor:
        info = self.info(key)
        tensor = self._handle(info.file).get_tensor(key)
        self.log.record(key, tensor, info.nbytes, self.check_values)
        return tensor

    def get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of dim 0 only (a ``safe_open`` slice: no other bytes are read)."""
        info = self.info(key)
        if not info.shape or not 0 <= start <= stop <= info.shape[0]:
            raise CheckpointError(f"tensor {key!r} of shape {list(info.shape)} has no rows [{start}, {stop})")
        tensor = self._handle(info.file).get_slice(key)[start:stop]
        self.log.record(key, tensor, info.nbytes // info.shape[0] * (stop - start), self.check_values)
        return tensor

    # ----------------------------------------------------------------- positional reads (converter)

    def _fd(self, file: str) -> int:
        """A read-only descriptor of shard ``file`` (opened once, closed by ``close``)."""
        with self._lock:
            if file not in self._fds:
                try:
                    self._fds[file] = os.open(self.path / file, os.O_RDONLY)
                except FileNotFoundError:
                    raise CheckpointError(f"checkpoint shard {self.path / file} is missing") from None
            return self._fds[file]

    def pread_into(self, file: str, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the bytes of ``file`` from absolute ``offset`` (no mmap)."""
        fd, done = self._fd(file), 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:  # the file shrank after its header was checked
                raise CheckpointError(f"{self.path / file} is truncated: read stopped at byte {offset + done}")
            done += n

    def pread(self, key: str, log: ReadLog | None = None) -> torch.Tensor:
        """Tensor ``key`` read with ``pread`` into fresh memory, recorded in ``log`` (default ``self.log``)."""
        info = self.info(key)
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        if info.nbytes:
            self.pread_into(info.file, memoryview(buf.numpy()), info.offset)
        tensor = buf.view(info.dtype).reshape(info.shape)
        (self.log if log is None else log).record(key, tensor, info.nbytes, self.check_values)
        return tensor
