"""The one reader of safetensors checkpoint directories: headers checked up front, tensors on request.

``CheckpointReader`` parses and checks every shard header when it is built (no tensor bytes are
read), enforcing what safetensors itself enforces and what a PTQ tool must (the trust boundary: a
lying checkpoint is refused in milliseconds, naming the file and the tensor):

- every file it opens (config, index, shard) is a regular file (a FIFO or a device would hang or
  stream forever), opened without blocking;
- a header is at most ``MAX_HEADER_BYTES`` (safetensors' own cap), checked before it is read, and is
  a JSON object without duplicate keys;
- every dtype is known, every dim >= 0, ``numel x itemsize`` equals the tensor's ``data_offsets``
  span, and the tensors tile the data exactly: sorted by offset they start at 0, each begins where
  the previous ends (no overlap, no gap) and the last ends at the end of the file;
- the index and the shards agree tensor for tensor, and every shard name the index gives stays
  inside the checkpoint (``shard_path``: a plain file name; a shard that is a symlink must resolve
  inside the checkpoint or, for a Hugging Face cache snapshot ``<repo>/snapshots/<rev>/``, inside
  that repository's ``<repo>/blobs/``). It also fingerprints the headers (``header_digest``), which the
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
import re
import stat
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# safetensors refuses larger headers (its MAX_HEADER_SIZE); checked before a byte of it is read.
MAX_HEADER_BYTES = 100_000_000
# config.json and the index are small; a bound keeps a planted multi-GB "config" from being read whole.
MAX_JSON_BYTES = 256 * 2**20

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
    if not config.exists():
        raise CheckpointError(f"{path} has no config.json; is it a checkpoint directory?")
    data = read_json(config)
    if not isinstance(data, dict):
        raise CheckpointError(f"{config} is not valid JSON: not a JSON object")
    return data


# --------------------------------------------------------------------------- files


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (symlinks followed).

    Opened with ``O_NONBLOCK`` (opening a FIFO for reading would otherwise wait for a writer) and
    checked with ``fstat`` on the descriptor itself, so a file swapped after a ``stat`` is caught too.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except IsADirectoryError:
        raise CheckpointError(f"checkpoint file {path} is a directory, not a file") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint file {path} cannot be opened: {e.strerror or e}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a directory" if stat.S_ISDIR(mode) else "not a regular file")
        raise CheckpointError(f"checkpoint file {path} is {kind}; only regular files are read")
    os.set_blocking(fd, True)
    return fd


def _read_exactly(fd: int, n: int, offset: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.pread(fd, n - len(out), offset + len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """``json`` object hook: refuse a key given twice (JSON allows it, and the last one would win silently)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def parse_json(text: bytes | str) -> object:
    """Strict JSON: duplicate keys refused (``ValueError``), as is ``NaN``/``Infinity``."""
    def no_constants(name: str) -> object:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=no_constants)


def read_json(path: Path, *, limit: int = MAX_JSON_BYTES) -> object:
    """A small JSON file of the checkpoint (config, index), read through ``open_regular``; errors name it."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(f"{path} is {size} bytes, more than the {limit} a JSON file of a checkpoint may be")
        text = _read_exactly(fd, size, 0)
    finally:
        os.close(fd)
    try:
        return parse_json(text)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def shard_path(root: Path, name: object, where: Path) -> Path:
    """The path of shard ``name`` (as the index gives it) in checkpoint ``root``, refused unless it stays inside.

    The name must be a plain file name in ``root`` (no directory part: ``../x``, ``/abs``, ``sub/x`` and
    ``sub/../../x`` are refused as written, before any file is touched; checkpoints are flat, and so is
    every output the tools write). A shard that is a symlink must resolve inside ``root`` too, except
    that a Hugging Face cache snapshot ``<repo>/snapshots/<rev>/`` may link into its own
    ``<repo>/blobs/`` (how the hub cache stores every file). ``where``: the file that named it.
    """
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"{where}: shard name {name!r} is not a file name")
    if "/" in name or "\\" in name or name in (".", ".."):
        raise CheckpointError(f"{where}: shard name {name!r} leaves the checkpoint directory {root}; a shard "
                              "must be named by a plain file name inside it (no directory part, no '..')")
    path = root / name
    if path.is_symlink():
        real, base = path.resolve(), root.resolve()
        allowed = [base]
        if base.parent.name == "snapshots":  # <repo>/snapshots/<rev>
            allowed.append(base.parent.parent / "blobs")
        if not any(real.is_relative_to(a) for a in allowed):
            raise CheckpointError(f"{where}: shard {name} resolves to {real}, outside the checkpoint directory "
                                  f"{root}{' and its Hugging Face cache blobs' if len(allowed) > 1 else ''}")
    return path


# --------------------------------------------------------------------------- headers


def _read_index(path: Path) -> dict[str, str]:
    """``weight_map`` of a safetensors index file: tensor name -> shard file name (every name checked
    by ``shard_path``)."""
    try:
        index = read_json(path)
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise TypeError("weight_map is not a mapping of tensor names to file names")
    except CheckpointError as e:
        raise CheckpointError(f"{path} is not a valid safetensors index: {e}") from None
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is not a valid safetensors index: {e}") from None
    for file in set(weight_map.values()):
        shard_path(path.parent, file, path)
    return weight_map


def read_weight_map(path: Path) -> dict[str, str]:
    """Tensor name -> shard file of checkpoint ``path`` (its index, else the single file's header)."""
    path = Path(path)
    if (path / INDEX_NAME).exists():
        return _read_index(path / INDEX_NAME)
    if (path / SINGLE_NAME).exists():
        return dict.fromkeys((k for k in read_header(path / SINGLE_NAME) if k != "__metadata__"), SINGLE_NAME)
    raise CheckpointError(f"{path} has neither {INDEX_NAME} nor {SINGLE_NAME}")


def _read_raw_header(path: Path) -> tuple[bytes, dict, int]:
    """(length prefix + JSON header bytes, the parsed header, file size) of one safetensors file."""
    if not path.exists() and not path.is_symlink():
        raise CheckpointError(f"checkpoint shard {path} is missing")
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        (n,) = struct.unpack("<Q", _read_exactly(fd, 8, 0))
        if n > MAX_HEADER_BYTES:  # refused before a byte of it is read (or allocated)
            raise ValueError(f"the header claims {n} bytes, more than safetensors' limit of {MAX_HEADER_BYTES}")
        if 8 + n > size:
            raise ValueError(f"the header claims {n} bytes but the file has {size}")
        text = _read_exactly(fd, n, 8)
        header = parse_json(text)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint shard {path} is missing") from None
    except (struct.error, ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"checkpoint shard {path} has a corrupt safetensors header: {e}") from None
    finally:
        os.close(fd)
    if not isinstance(header, dict):
        raise CheckpointError(f"checkpoint shard {path} has a corrupt safetensors header: not a JSON object")
    return struct.pack("<Q", n) + text, header, size


def read_header(path: Path) -> dict:
    """The parsed JSON header of one safetensors file, every entry checked as ``read_shard`` does (no
    tensor bytes are read); errors name the file."""
    return read_shard(Path(path)).header


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
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: __metadata__ is not a mapping of strings")
    tensors = {
        key: _tensor_info(path, file or path.name, key, meta, len(raw), size)
        for key, meta in header.items() if key != "__metadata__"
    }
    _check_tiling(path, tensors, len(raw), size)
    return ShardHeader(raw, header, tensors, size)


def _check_tiling(path: Path, tensors: dict[str, TensorInfo], data_start: int, size: int) -> None:
    """The tensors' byte ranges tile the data exactly (safetensors' own rule): sorted by offset, each
    starts where the previous ended, the first at 0, the last at the end of the file. Overlapping
    ranges would hand two tensors the same bytes; a gap or a tail is bytes no tensor accounts for."""
    pos = data_start
    for key, t in sorted(tensors.items(), key=lambda kv: (kv[1].offset, kv[1].nbytes)):
        if t.offset != pos:
            what = "overlaps the tensor before it" if t.offset < pos else "leaves a gap before it"
            raise CheckpointError(f"{path}: tensor {key}'s data_offsets [{t.offset - data_start}, "
                                  f"{t.offset - data_start + t.nbytes}] {what} (expected to start at {pos - data_start})")
        pos += t.nbytes
    if pos != size:
        raise CheckpointError(f"{path}: the tensors end at byte {pos} but the file has {size} bytes "
                              "(trailing bytes no tensor accounts for)")


def _tensor_info(path: Path, file: str, key: str, meta: object, data_start: int, size: int) -> TensorInfo:
    """One header entry, checked: known dtype, offsets spanning exactly dtype x shape, inside the file."""
    try:
        if not isinstance(meta, dict) or set(meta) != {"dtype", "shape", "data_offsets"}:
            raise KeyError("want exactly dtype, shape and data_offsets")
        dtype = SAFETENSORS_DTYPES.get(meta["dtype"]) if isinstance(meta["dtype"], str) else None
        shape = tuple(_int(d) for d in meta["shape"])
        begin, end = (_int(x) for x in meta["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: header entry of tensor {key} is malformed: {str(meta)[:200]} ({e})") from None
    if dtype is None:
        raise CheckpointError(f"{path}: tensor {key} has unsupported dtype {meta['dtype']!r}")
    if any(d < 0 for d in shape):
        raise CheckpointError(f"{path}: tensor {key} has a negative dimension in its shape {list(shape)}")
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


def _int(value: object) -> int:
    """A JSON integer (not a bool, a float or a string, which ``int()`` would accept)."""
    if type(value) is not int:
        raise TypeError(f"{value!r} is not an integer")
    return value


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


_ROWS = re.compile(r"^(?P<key>.+)\[(?P<start>\d+):(?P<stop>\d+)\]$")


def rows_read(key: str, start: int, stop: int) -> str:
    """How a read of rows ``[start, stop)`` of ``key`` is named in ``ReadLog.hashes``."""
    return f"{key}[{start}:{stop}]"


def parse_read(read: str) -> tuple[str, tuple[int, int] | None]:
    """``rows_read``'s inverse: (key, (start, stop)) for a rows read, (key, None) for a whole tensor."""
    m = _ROWS.match(read)
    return (m["key"], (int(m["start"]), int(m["stop"]))) if m else (read, None)


@dataclass
class ReadLog:
    """Every tensor read (key, bytes) and what in it is not a number. Thread-safe: converter workers share one."""

    keys: list[str] = field(default_factory=list)
    bytes: int = 0
    invalid: dict[str, str] = field(default_factory=dict)  # key -> what is not a number in it
    # key -> sha256 of the bytes read (``pread`` only, when not None): the converter's source identity.
    hashes: dict[str, str] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def hash_read(self, read: str, tensor: torch.Tensor) -> None:
        """The sha256 of the bytes just read, under ``read`` (a key, or ``key[start:stop]`` for rows), when
        hashing is on: what a resume compares the source against, computed once, with no second pass."""
        if self.hashes is not None:
            digest = hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
            with self._lock:
                self.hashes[read] = digest

    def record(self, key: str, tensor: torch.Tensor, nbytes: int, check_values: bool,
               shown: Callable[[str], str] | None = None) -> None:
        """``shown``: the name an error gives ``key`` (a view's key: the stored tensor it is part of), asked only then."""
        found = None
        if check_values:
            from .nonfinite import invalid_values

            found = invalid_values(key, tensor)
        with self._lock:
            self.keys.append(key)
            self.bytes += nbytes
            if found is not None:
                self.invalid[shown(key) if shown else key] = found


# A view: a function of the checked headers returning the tensors the pipeline should see
# (``LoadingSpec.checkpoint_view``: a model whose checkpoint stores what the pipeline reads per expert in
# another layout). Every entry it returns is a contiguous byte range of a stored tensor (e.g. GPT-OSS's fused
# MXFP4 experts, ``[E, ...]``, as per-expert ``weight_packed``/``weight_scale``), read with ``pread`` (a
# virtual key is no safetensors name).
CheckpointView = Callable[[Mapping[str, TensorInfo]], dict[str, TensorInfo]]


class _FromConfig:
    """``CheckpointReader(view=)``'s default: the view of the spec the checkpoint's config.json names."""


def _view_for(path: Path) -> CheckpointView | None:
    """The view the spec of the checkpoint at ``path`` (its config.json's model_type) declares, if any."""
    try:
        model_type = read_config(path).get("model_type") if (path / "config.json").is_file() else None
    except CheckpointError:  # reported by whoever reads the config for its contents
        return None
    if not isinstance(model_type, str):
        return None
    from ..spec import SpecError, get_spec  # the spec registry (imports a built-in spec lazily)

    try:
        return get_spec(model_type).loading.checkpoint_view
    except SpecError:
        return None


class CheckpointReader:
    """Key -> tensor access over ``model.safetensors.index.json`` (or a single ``model.safetensors``).

    Headers are parsed and checked on construction; file handles open on the first read of a file
    and close with ``close()`` (or the ``with`` block), after which they reopen on demand. ``view``: the
    checkpoint view of the model's spec (``LoadingSpec.checkpoint_view``; None: the stored tensors as they
    are), given by a caller that decided the spec; by default the spec config.json names is looked up.
    """

    def __init__(self, path: str | Path, *, check_values: bool = True,
                 view: CheckpointView | None | type[_FromConfig] = _FromConfig) -> None:
        self.path = Path(path)
        self.check_values = check_values
        self._view = view
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        self.log = ReadLog()
        self.files: list[str] = []  # shard file names, sorted
        self.sizes: dict[str, int] = {}  # shard file -> size in bytes
        self._infos: dict[str, TensorInfo] = {}
        self._virtual: frozenset[str] = frozenset()  # keys a view made (read by byte range)
        self._stored: Mapping[str, TensorInfo] = {}  # what the shards store, before a view
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
            shard = read_shard(shard_path(self.path, file, self.path / INDEX_NAME), file)
            if weight_map is not None:
                _check_listed(self.path / file, shard.header, listed_in[file], weight_map)
            self.sizes[file] = shard.size
            self._infos.update(shard.tensors)
            digest.update(f"{file}\0{shard.size}\0".encode())
            digest.update(shard.raw)
        view = _view_for(self.path) if self._view is _FromConfig else self._view
        self._stored = self._infos
        if view is not None:
            self._infos = view(self._stored)
            self._virtual = frozenset(k for k in self._infos if k not in self._stored)
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

    def stored_name(self, key: str) -> str:
        """The stored tensor that holds ``key``: itself, or for a name a view derives, the stored tensor whose
        bytes it is (errors name what the user can find in the shards, not a name only the view knows)."""
        if key not in self._virtual:
            return key
        info = self._infos[key]
        for name, stored in self._stored.items():
            if stored.file == info.file and stored.offset <= info.offset < stored.offset + max(stored.nbytes, 1):
                return name
        return key

    def describe(self, key: str) -> str:
        """``key`` as an error should name it: the stored tensor, with the view's name for the part of it."""
        stored = self.stored_name(key)
        return key if stored == key else f"{stored} (the part the view calls {key})"

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
        if key in self._virtual:
            return self.pread(key)
        info = self.info(key)
        tensor = self._handle(info.file).get_tensor(key)
        self.log.hash_read(key, tensor)
        self.log.record(key, tensor, info.nbytes, self.check_values)
        return tensor

    def get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of dim 0 only (a ``safe_open`` slice: no other bytes are read)."""
        info = self.info(key)
        if not info.shape or not 0 <= start <= stop <= info.shape[0]:
            raise CheckpointError(f"tensor {key!r} of shape {list(info.shape)} has no rows [{start}, {stop})")
        if key in self._virtual:  # a byte range: read just these rows
            row = info.nbytes // info.shape[0] if info.shape[0] else 0
            buf = torch.empty(row * (stop - start), dtype=torch.uint8)
            if buf.numel():
                self.pread_into(info.file, memoryview(buf.numpy()), info.offset + row * start)
            tensor = buf.view(info.dtype).reshape(stop - start, *info.shape[1:])
        else:
            tensor = self._handle(info.file).get_slice(key)[start:stop]
        self.log.hash_read(rows_read(key, start, stop), tensor)
        self.log.record(key, tensor, info.nbytes // info.shape[0] * (stop - start), self.check_values, self.describe)
        return tensor

    # ----------------------------------------------------------------- positional reads (converter)

    def _fd(self, file: str) -> int:
        """A read-only descriptor of shard ``file`` (opened once, closed by ``close``)."""
        with self._lock:
            if file not in self._fds:
                self._fds[file] = open_regular(self.path / file)
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
        log = self.log if log is None else log
        log.hash_read(key, buf)
        log.record(key, tensor, info.nbytes, self.check_values, self.describe)
        return tensor

    def sha256(self, read: str, chunk: int = 64 * 2**20) -> str:
        """sha256 of the stored bytes of ``read`` (a key, or ``key[start:stop]``: those rows of dim 0, as
        ``ReadLog.hash_read`` names them), read in chunks (nothing recorded: a check, not a read)."""
        key, rows = (read, None) if read in self._infos else parse_read(read)
        info = self.info(key)
        offset, nbytes = info.offset, info.nbytes
        if rows is not None:
            row = info.nbytes // info.shape[0] if info.shape and info.shape[0] else 0
            offset, nbytes = offset + row * rows[0], row * (rows[1] - rows[0])
        h = hashlib.sha256()
        buf = bytearray(min(chunk, max(nbytes, 1)))
        view = memoryview(buf)
        done = 0
        while done < nbytes:
            n = min(len(view), nbytes - done)
            self.pread_into(info.file, view[:n], offset + done)
            h.update(view[:n])
            done += n
        return h.hexdigest()
