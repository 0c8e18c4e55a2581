"""The source checkpoint: scan and validate the safetensors headers, and read tensors with ``pread``."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from ..checkpoint import _ST_DTYPES, INDEX_NAME, SINGLE_NAME, CheckpointError, read_header


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
