"""Lazy, instrumented access to a safetensors checkpoint directory.

Only headers are parsed up front; tensor bytes are read on request through ``safe_open`` (which
memory-maps and reads just the requested tensor). Every read is recorded (key and bytes) so tests
and benchmarks can prove that an expert-parallel rank never touches another rank's experts, and
every tensor read is checked for values that are not numbers (``nonfinite.invalid_values``: one
reduction over the bytes just read), recorded in ``log.invalid`` for the caller to act on.
Only safetensors is ever read: no pickle.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_ST_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(RuntimeError):
    """The checkpoint directory is missing files or inconsistent; the message names the file/key."""


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def read_config(path: Path) -> dict:
    """A checkpoint directory's ``config.json``, parsed (no remote code runs); errors name the file."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{path} has no config.json; is it a checkpoint directory?")
    try:
        return json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config} is not valid JSON: {e}") from None


def read_header(path: Path) -> dict:
    """The JSON header of one safetensors file (no tensor bytes are read)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint shard {path} is missing") from None
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint shard {path} has a corrupt safetensors header: {e}") from None
    return header


@dataclass
class ReadLog:
    keys: list[str] = field(default_factory=list)
    bytes: int = 0
    invalid: dict[str, str] = field(default_factory=dict)  # key -> what is not a number in it

    def record(self, key: str, tensor: torch.Tensor, nbytes: int, check_values: bool) -> None:
        self.keys.append(key)
        self.bytes += nbytes
        if check_values:
            from .nonfinite import invalid_values

            found = invalid_values(key, tensor)
            if found is not None:
                self.invalid[key] = found


class CheckpointReader:
    """Key -> tensor access over ``model.safetensors.index.json`` (or a single ``model.safetensors``)."""

    def __init__(self, path: str | Path, *, check_values: bool = True) -> None:
        self.path = Path(path)
        self.check_values = check_values
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        self.log = ReadLog()
        index = self.path / INDEX_NAME
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.path / SINGLE_NAME).exists():
            weight_map = {k: SINGLE_NAME for k in read_header(self.path / SINGLE_NAME) if k != "__metadata__"}
        else:
            raise CheckpointError(f"{self.path} has neither {INDEX_NAME} nor {SINGLE_NAME}")
        self._infos: dict[str, TensorInfo] = {}
        for file in sorted(set(weight_map.values())):
            header = read_header(self.path / file)
            size = (self.path / file).stat().st_size
            with open(self.path / file, "rb") as f:
                data_start = 8 + struct.unpack("<Q", f.read(8))[0]
            for key, meta in header.items():
                if key == "__metadata__" or weight_map.get(key) != file:
                    continue
                begin, end = meta["data_offsets"]
                if data_start + end > size:
                    raise CheckpointError(
                        f"{self.path / file} is truncated: tensor {key} ends at byte {data_start + end} but the "
                        f"file has {size} bytes"
                    )
                dtype = _ST_DTYPES.get(meta["dtype"])
                if dtype is None:
                    raise CheckpointError(f"{self.path / file}: tensor {key} has unsupported dtype {meta['dtype']}")
                self._infos[key] = TensorInfo(file, dtype, tuple(meta["shape"]), end - begin)
        missing = sorted(set(weight_map) - set(self._infos))
        if missing:
            raise CheckpointError(f"index names tensors absent from their shard files: {missing[:8]}")
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

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

    def _handle(self, file: str):
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

