"""All checkpoint writing: safetensors shards, the index, configs and side files, atomically.

Two shard strategies share one header layout, dtype map and byte path:

- ``ShardWriter`` (the model export): tensors arrive one by one, in any size; it buffers them,
  spills them to a side file past ``spill_bytes``, and cuts a shard at ``max_shard_bytes``.
- ``PlannedShard`` (the streaming converter): every tensor's name, dtype and shape is known before
  any value is computed, so the header is written first and each tensor is written in place at its
  offset, in any order and from any thread, or copied from the source through one buffer. Its digest
  (``ShardDigest``) is taken from the bytes as they are written, so the file is never read back to be
  hashed. Memory holds a few tensors, never a shard.

Typical use of ``ShardWriter`` on every rank::

    with atomic_output_dir(export_dir, overwrite=args.overwrite) as tmp:
        def write_mine():
            with ShardWriter(tmp, rank=g.rank) as w:
                for name, tensor in my_tensors():  # produced lazily
                    w.add(name, tensor)
            return w.weight_map, w.total_bytes
        local_map, local_bytes = run_together("write shards", write_mine)
        maps, total = gather_weight_maps(local_map, local_bytes)   # only the index travels
        if g.is_main:
            run_together("write index", write_index, tmp, maps, total)  # plus configs
        else:
            run_together("write index", lambda: None)

Collectives inside the block must follow a ``run_together`` of the local work (as above):
a rank that raised would otherwise meet its peers in mismatched collectives.
``export_dir`` must be on a filesystem that every rank sees (checked on entry).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import struct
import threading
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import save

from modelopt_k3.checkpoint import (
    INDEX_NAME,
    SAFETENSORS_DTYPES,
    SINGLE_NAME,
    CheckpointError,
    CheckpointReader,
    TensorInfo,
    read_config,
    read_shard,
)
from modelopt_k3.checkpoint.serving_rules import SIDECAR_DIRS
from modelopt_k3.dist.collectives import (
    DistributedStepError,
    all_gather_object,
    broadcast_object,
    run_together,
)
from modelopt_k3.dist.group import RunGroup, current_group
from modelopt_k3.export.modelopt_format import strip_source_quantization
from modelopt_k3.export.staging import StagingDir, remove_tree, sweep_stale
from modelopt_k3.files.paths import create_new, write_new
from modelopt_k3.numerics.finite import nonfinite_count

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_NAME",
    "PlannedShard",
    "PlannedTensor",
    "ShardDigest",
    "ShardWriter",
    "atomic_output_dir",
    "copy_side_files",
    "file_digest",
    "gather_weight_maps",
    "write_configs",
    "write_index",
    "write_json_atomic",
]

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
# Buffered bytes above which a shard's tensors go to its spill file (bounds export memory: what export
# adds to a rank's peak after calibration; 64 MiB keeps it within 5% there, benchmarks/bench_ep.py).
DEFAULT_SPILL_BYTES = 64 * 2**20
# Bytes moved through this process at a time (spill assembly, checked copies); a multiple of every itemsize.
COPY_CHUNK = 64 * 2**20
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
# What a writer writes itself, or never copies: everything else in a source checkpoint directory
# that is not a safetensors shard (remote code, tokenizer, generation config) is copied as it is.
_NOT_SIDE_FILES = {INDEX_NAME, SINGLE_NAME, "config.json", "hf_quant_config.json"}
_TMP_RE = re.compile(r"^\..+\.tmp-(?P<pid>\d+)-[0-9a-f]+$")


# --------------------------------------------------------------------------- bytes and files


def tensor_bytes(t: torch.Tensor):
    """The raw bytes of ``t`` (C order), without a copy where ``t`` is contiguous."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy() if t.numel() else b""


def header_bytes(
    metadata: dict[str, str], tensors: Iterable[tuple[str, torch.dtype, Sequence[int], int]]
) -> tuple[bytes, dict[str, int]]:
    """A safetensors header (length prefix included) for ``(name, dtype, shape, nbytes)`` in file order,
    and each tensor's offset from the start of the data."""
    header: dict[str, object] = {"__metadata__": metadata}
    offsets: dict[str, int] = {}
    pos = 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        offsets[name] = pos
        pos += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
    return struct.pack("<Q", len(text)) + text, offsets


def pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _tmp_name(path: Path) -> Path:
    # Unique per writer: ranks on different hosts may share a pid and write to one shared filesystem;
    # unpredictable, and created with O_EXCL | O_NOFOLLOW (``files.paths.create_new``): nothing planted is opened.
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}")


def is_tmp_name(name: str) -> tuple[bool, int]:
    """(whether ``name`` is one of ``_tmp_name``'s, the pid that made it)."""
    m = _TMP_RE.match(name)
    return (True, int(m["pid"])) if m else (False, 0)


def write_json_atomic(path: Path, obj: dict) -> None:
    """``path`` holds the old content or all of ``obj`` (indented JSON), never a part of it."""
    tmp = _tmp_name(path)
    write_new(tmp, (json.dumps(obj, indent=2) + "\n").encode())
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def copy_side_files(src: Path, dst: Path) -> None:
    """Copy every file of checkpoint ``src`` that is not a shard, the index or a config (remote code,
    tokenizer, generation config, chat templates, processor configs) into ``dst``, and the files of the sidecar
    directories a tokenizer loads (``SIDECAR_DIRS``), each atomically, with the mode every output file has."""
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name not in _NOT_SIDE_FILES and not path.name.endswith(".safetensors"):
            _copy_one(path, dst / path.name)
    for name in SIDECAR_DIRS:
        folder = src / name
        if folder.is_dir() and not folder.is_symlink():
            out = dst / name
            if out.is_symlink() or (out.exists() and not out.is_dir()):  # never written through what was planted
                raise CheckpointError(f"{out} exists and is not a directory of ours (a link or a file): not "
                                      f"writing {name}/ through it")
            out.mkdir(exist_ok=True)
            for path in sorted(folder.iterdir()):
                if path.is_file():
                    _copy_one(path, dst / name / path.name)


def _copy_one(path: Path, out: Path) -> None:
    tmp = _tmp_name(out)
    fd = create_new(tmp)
    try:
        with open(path, "rb") as fin, open(fd, "wb", closefd=True) as fout:
            shutil.copyfileobj(fin, fout, COPY_CHUNK)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_configs(src: Path, dst: Path, quantization_config: dict, hf_quant: dict | None) -> None:
    """``config.json`` (the source's, its quantization replaced by ``quantization_config``) and, when
    given, ``hf_quant_config.json``."""
    config = strip_source_quantization(read_config(src))
    config["quantization_config"] = quantization_config
    write_json_atomic(dst / "config.json", config)
    if hf_quant is not None:
        write_json_atomic(dst / "hf_quant_config.json", hf_quant)


# --------------------------------------------------------------------------- atomic directory


def _is_nonempty(path: Path) -> bool:
    if not path.exists() and not path.is_symlink():
        return False
    if not path.is_dir() or path.is_symlink():
        return True
    return any(path.iterdir())


def _refuse_existing(export_dir: Path) -> None:
    if _is_nonempty(export_dir):
        raise FileExistsError(
            f"export directory {export_dir} already exists and is not empty; "
            "pass overwrite=True (the CLI's --overwrite) to replace it, or choose another path"
        )


def refuse_replacing_a_non_checkpoint(export_dir: Path) -> None:
    """``--overwrite`` replaces the export directory as a whole (deleting it once the new one is in place): the
    command line replaces only a checkpoint directory (its ``config.json`` and index or single shard), never,
    say, a home directory given by mistake. (``atomic_output_dir(overwrite=True)`` itself replaces any.)"""
    if not _is_nonempty(export_dir):
        return
    is_checkpoint = export_dir.is_dir() and not export_dir.is_symlink() and (export_dir / "config.json").is_file() \
        and ((export_dir / INDEX_NAME).is_file() or (export_dir / SINGLE_NAME).is_file())
    if not is_checkpoint:
        raise FileExistsError(
            f"export directory {export_dir} is not empty and is not a checkpoint (no config.json with "
            f"{INDEX_NAME} or {SINGLE_NAME}); overwrite replaces only a checkpoint directory, deleting the old "
            "one: choose another path, or empty it yourself"
        )


def _make_tmp_dir(export_dir: Path, overwrite: bool) -> StagingDir:
    sweep_stale(export_dir)  # what dead runs left next to this export path
    if not overwrite:
        _refuse_existing(export_dir)
    export_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = StagingDir(export_dir, "tmp")
    staging.mkdir()
    return staging


def _check_visible(tmp: Path) -> None:
    if not tmp.is_dir():
        raise FileNotFoundError(
            f"temporary export directory {tmp} made by rank 0 is not visible here; "
            "the export path must be on a filesystem shared by all ranks"
        )


def _publish(staging: StagingDir, export_dir: Path, overwrite: bool) -> None:
    """Rank 0: move the staging dir to ``export_dir``; an old directory is moved aside first, then deleted."""
    aside: StagingDir | None = None
    if export_dir.exists() or export_dir.is_symlink():
        if _is_nonempty(export_dir):
            if not overwrite:
                _refuse_existing(export_dir)  # appeared while we were writing
            aside = StagingDir(export_dir, "old").claim()
            export_dir.rename(aside.path)
        else:
            export_dir.rmdir()  # empty directory: rename() onto it is not portable
    try:
        staging.path.rename(export_dir)
    except BaseException:
        if aside is not None:
            aside.path.rename(export_dir)  # put the old checkpoint back
            aside.release()
        raise
    staging.release()
    if aside is not None:
        aside.discard()


@contextlib.contextmanager
def atomic_output_dir(
    export_dir: Path | str, *, overwrite: bool = False, group: RunGroup | None = None
) -> Iterator[Path]:
    """Yield one temporary sibling of ``export_dir`` that all ranks write into.

    ``export_dir`` appears, complete, only if the block succeeded on every rank; otherwise every
    rank raises and the temporary directory is deleted (by rank 0; by every rank on SIGTERM or
    another ``BaseException``, since rank 0 may be the one that died). Temporary directories that
    dead runs left next to ``export_dir`` are removed first (``staging.sweep_stale``). An existing
    non-empty ``export_dir`` is refused unless ``overwrite=True``, in which case it is replaced only
    once the new one is complete. Must be entered on every rank.
    """
    g = group if group is not None else current_group()
    export_dir = Path(export_dir).absolute()

    staging = run_together(
        "create export dir", lambda: _make_tmp_dir(export_dir, overwrite) if g.is_main else None, group=g
    )
    tmp: Path | None = None
    published = False
    interrupted = False
    try:  # from here on rank 0's staging directory is discarded whatever happens (a peer dying included)
        tmp = Path(broadcast_object(None if staging is None else str(staging.path), src=0, group=g,
                                    step="share export dir"))
        run_together("check export dir is shared", _check_visible, tmp, group=g)
        try:
            yield tmp
        except Exception as exc:
            if g.world_size > 1 and not isinstance(exc, DistributedStepError):
                # Peers are unaware; meet them at the agreement they are heading for.
                run_together("write export dir", _reraise, exc, group=g)
            raise
        run_together("write export dir", lambda: None, group=g)
        # The agreement above is the barrier before the rename; this one's is the barrier after.
        run_together(
            "publish export dir", lambda: _publish(staging, export_dir, overwrite) if g.is_main else None, group=g
        )
        published = True
    except BaseException as exc:
        interrupted = not isinstance(exc, Exception)  # SIGTERM (as SystemExit), KeyboardInterrupt, ...
        raise
    finally:
        if not published:
            if staging is not None:
                staging.discard()
            elif interrupted and tmp is not None:
                remove_tree(tmp)  # rank 0 may be the rank that was killed


def _reraise(exc: BaseException) -> None:
    raise exc


# --------------------------------------------------------------------------- buffered shards (export)


def _copy_into(src: Path, out_fd: int, out_offset: int, nbytes: int) -> None:
    """Copy the first ``nbytes`` of ``src`` to ``out_fd`` at ``out_offset``: in the kernel where it can
    (``copy_file_range``, no trip through user space), else through a buffer."""
    in_fd = os.open(src, os.O_RDONLY)
    try:
        done = 0
        if hasattr(os, "copy_file_range"):
            try:
                while done < nbytes:
                    n = os.copy_file_range(in_fd, out_fd, nbytes - done, done, out_offset + done)
                    if n == 0:
                        break
                    done += n
            except OSError:  # EXDEV, ENOSYS, EINVAL on some filesystems: finish through a buffer
                pass
        while done < nbytes:
            chunk = os.pread(in_fd, min(COPY_CHUNK, nbytes - done), done)
            if not chunk:
                raise OSError(f"spill file {src} ended at byte {done} of {nbytes}")
            pwrite_all(out_fd, chunk, out_offset + done)
            done += len(chunk)
    finally:
        os.close(in_fd)


class ShardWriter:
    """Buffer tensors and write safetensors shards of at most ``max_shard_bytes`` each.

    Memory stays bounded by ``spill_bytes`` (plus one tensor): once a shard's buffered tensors pass
    it, their bytes go to a spill file next to the shard, and the shard is assembled from it (header,
    then the spilled bytes) when it is full. A shard that never spills is written as safetensors'
    ``save`` bytes, into a file created new. A tensor larger than the limit gets a shard of its own. A view is buffered as it is
    (no copy; it keeps what it views alive until spilled), so a tensor must not change once added. File names are
    unique per rank: ``{prefix}-r{rank:05d}-{i:05d}.safetensors``; ``write_index`` renames them.
    """

    def __init__(
        self,
        out_dir: Path | str,
        *,
        prefix: str = "model",
        rank: int = 0,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        metadata: dict[str, str] | None = None,
        spill_bytes: int = DEFAULT_SPILL_BYTES,
    ):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.out_dir = Path(out_dir)
        self.prefix = prefix
        self.rank = rank
        self.max_shard_bytes = max_shard_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self.weight_map: dict[str, str] = {}  # key -> file name, for written and buffered keys
        self.total_bytes = 0
        self.num_shards = 0
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._closed = False
        self.spill_bytes = spill_bytes
        self._spilled: list[tuple[str, torch.dtype, list[int], int]] = []  # name, dtype, shape, nbytes (in order)
        self._spill_file = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._closed:
            raise RuntimeError(f"ShardWriter for {self.out_dir} is closed; cannot add {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.layout != torch.strided:
            raise ValueError(f"{name!r}: only dense tensors can be saved, got layout {tensor.layout}")
        if name in self.weight_map:
            raise ValueError(f"tensor {name!r} added twice (first in {self.weight_map[name]})")

        t = tensor.detach().to("cpu").contiguous()
        # Views are kept as they are (a slice of a batched cast, a tensor read from a shard): the spill file
        # takes their bytes straight from them; only ``save_file``, which refuses views and shared memory,
        # gets copies (``_independent``), when a shard is written without spilling.
        if (self._buffer or self._spilled) and self._buffer_bytes + t.nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = t
        self._buffer_bytes += t.nbytes
        self.total_bytes += t.nbytes
        self.weight_map[name] = self._shard_name(self.num_shards)
        if self._buffer_bytes > self.spill_bytes:
            self._spill()

    def _spill_path(self) -> Path:
        return self.out_dir / f".{self._shard_name(self.num_shards)}.spill"

    def _spill(self) -> None:
        """Move the buffered tensors' bytes to this shard's spill file, in order."""
        if self._spill_file is None:
            # Created new (O_EXCL | O_NOFOLLOW): a link planted at the spill name is never written through.
            self._spill_file = open(create_new(self._spill_path()), "wb")  # noqa: SIM115 - closed in _flush/__exit__
        for name, t in self._buffer.items():
            self._spill_file.write(tensor_bytes(t))
            self._spilled.append((name, t.dtype, list(t.shape), t.nbytes))
        self._buffer = {}

    def _flush_spilled(self, path: Path) -> None:
        """Assemble a shard from its spill file: header (tensors in spill order), then the spilled bytes."""
        self._spill()
        self._spill_file.close()
        header, _ = header_bytes(self.metadata, self._spilled)
        spill = self._spill_path()
        out_fd = create_new(path)  # a fresh name in our own staging directory
        try:
            pwrite_all(out_fd, header, 0)
            _copy_into(spill, out_fd, len(header), sum(nbytes for *_, nbytes in self._spilled))
        finally:
            os.close(out_fd)
        spill.unlink()
        self._spill_file, self._spilled = None, []

    def _shard_name(self, i: int) -> str:
        return f"{self.prefix}-r{self.rank:05d}-{i:05d}.safetensors"

    def _flush(self) -> None:
        if not self._buffer and self._spill_file is None:
            return
        path = self.out_dir / self._shard_name(self.num_shards)
        if self._spill_file is not None:
            self._flush_spilled(path)
        else:
            # safetensors' bytes (at most ``spill_bytes`` here) into a file created new: ``save_file`` would open
            # the path as it finds it, following a link planted there.
            write_new(path, save(_independent(self._buffer), metadata=self.metadata))
        self.num_shards += 1
        self._buffer = {}
        self._buffer_bytes = 0

    def close(self) -> dict[str, str]:
        """Write what is buffered; return key -> file name. Idempotent."""
        if not self._closed:
            self._flush()
            self._closed = True
        return dict(self.weight_map)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not write a partial shard on error; drop the buffer and any spill file
            self._buffer, self._closed = {}, True
            if self._spill_file is not None:
                self._spill_file.close()
                self._spill_path().unlink(missing_ok=True)
                self._spill_file, self._spilled = None, []


def _independent(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every view, and every tensor sharing memory with an earlier one, copied: what
    ``save_file`` accepts (the bytes are the same)."""
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, t in tensors.items():
        storage = t.untyped_storage()
        if t.storage_offset() != 0 or storage.nbytes() != t.nbytes or storage.data_ptr() in storages:
            t = t.clone()
            storage = t.untyped_storage()
        storages.add(storage.data_ptr())
        out[name] = t
    return out


# --------------------------------------------------------------------------- planned shards (converter)


class PlannedTensor(NamedTuple):  # a NamedTuple: a Kimi-K3 conversion plans ~10**6 of them
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class ShardDigest:
    """The digest of a shard written out of order, from the bytes as they are written.

    The shard is cut into its segments, the header and then every tensor's byte range (sorted by offset,
    then name); the digest is sha256 over each segment's sha256, in that order. Writers add segments
    from any thread in any order; nothing is read back. ``file_digest`` computes the same from a file.
    """

    def __init__(self) -> None:
        self._parts: list[tuple[int, str, bytes]] = []
        self._lock = threading.Lock()

    def add(self, offset: int, name: str, digest: bytes) -> None:
        with self._lock:
            self._parts.append((offset, name, digest))

    def hexdigest(self) -> str:
        h = hashlib.sha256()
        for _, _, digest in sorted(self._parts):
            h.update(digest)
        return h.hexdigest()


def file_digest(path: Path) -> str:
    """``ShardDigest`` of a safetensors file on disk (its header checked by the one reader); "" for a file
    that is not a whole safetensors file, which matches no record."""
    try:
        shard = read_shard(path)
    except CheckpointError:
        return ""
    digest = ShardDigest()
    digest.add(0, "", hashlib.sha256(shard.raw).digest())
    buf = bytearray(min(COPY_CHUNK, max((t.nbytes for t in shard.tensors.values()), default=0)))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        for name, t in shard.tensors.items():
            h = hashlib.sha256()
            f.seek(t.offset)
            left = t.nbytes
            while left:
                n = f.readinto(view[: min(left, len(view))])
                if not n:
                    return ""  # shrank since its header was read: matches no record
                h.update(view[:n])
                left -= n
            digest.add(t.offset, name, h.digest())
    return digest.hexdigest()


class PlannedShard:
    """A safetensors file whose header is written first, from tensors planned before any value exists;
    each tensor is then written at its offset, in any order, from any thread (``write``/``copy``).

    Tensors are laid out by element size (largest first), then planned order, so every tensor starts
    at a multiple of its element size, as safetensors' own writer does. ``digest`` covers every byte
    written (``ShardDigest``). ``discard`` removes the file. ``path`` is created new (``files.paths.create_new``:
    a file or symlink already there refuses it), so it must be a fresh name (``files.paths.staging_path``).
    """

    def __init__(self, path: Path, planned: Sequence[PlannedTensor]):
        order = sorted(range(len(planned)), key=lambda i: (-planned[i].dtype.itemsize, i))
        header, rel = header_bytes({"format": "pt"}, ((*planned[i], planned[i].nbytes) for i in order))
        self.path = path
        self.planned = {t.name: t for t in planned}
        self.offsets = {name: len(header) + off for name, off in rel.items()}
        self.tensor_bytes = sum(t.nbytes for t in planned)
        self.total_bytes = len(header) + self.tensor_bytes
        self.digest = ShardDigest()
        self.copied: dict[str, str] = {}  # source key -> sha256 of the bytes copied (the source's own)
        self._fd = create_new(path)
        try:
            pwrite_all(self._fd, header, 0)
            self.digest.add(0, "", hashlib.sha256(header).digest())
            os.ftruncate(self._fd, self.total_bytes)
        except BaseException:
            self.discard()
            raise

    def write(self, name: str, tensor: torch.Tensor, sha256: bytes | None = None) -> None:
        """Write ``tensor`` at its planned offset. ``sha256``: the digest of exactly these bytes when the
        caller already has it (a source tensor written unchanged, hashed as it was read), else computed."""
        want = self.planned[name]
        if tensor.dtype != want.dtype or tuple(tensor.shape) != want.shape:
            raise AssertionError(
                f"{name}: produced {tensor.dtype} {list(tensor.shape)}, planned {want.dtype} {list(want.shape)}"
            )
        data = tensor_bytes(tensor)
        self.digest.add(self.offsets[name], name, sha256 if sha256 is not None else hashlib.sha256(data).digest())
        pwrite_all(self._fd, data, self.offsets[name])

    def copy(self, reader: CheckpointReader, key: str) -> str | None:
        """Copy source tensor ``key`` byte for byte to the planned tensor of that name; return what in
        it is not a number (None: all are).

        The bytes pass through one buffer (at most ``COPY_CHUNK``), hashed for the digest on the way
        (which spares reading the output back); floating tensors are checked chunk by chunk
        (``nonfinite_count`` on bytes already in memory), other dtypes cannot hold NaN.
        """
        info, offset = reader.info(key), self.offsets[key]
        sha, bad = _copy_chunks(reader, info, self._fd, offset, count_nonfinite=info.dtype.is_floating_point)
        self.digest.add(offset, key, sha)
        self.copied[key] = sha.hex()
        return f"{bad} NaN/Inf value{'s' if bad != 1 else ''}" if bad else None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def discard(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


def _copy_chunks(
    reader: CheckpointReader, t: TensorInfo, out_fd: int, out_offset: int, *, count_nonfinite: bool
) -> tuple[bytes, int]:
    """Copy the bytes of ``t`` through one buffer; return their sha256 and the NaN/Inf values counted."""
    buf = torch.empty(min(COPY_CHUNK, max(t.nbytes, 1)), dtype=torch.uint8)  # chunks hold whole elements
    view = memoryview(buf.numpy())
    h = hashlib.sha256()
    bad = done = 0
    while done < t.nbytes:
        n = min(len(view), t.nbytes - done)
        reader.pread_into(t.file, view[:n], t.offset + done)
        if count_nonfinite:
            bad += nonfinite_count(buf[:n].view(t.dtype))
        h.update(view[:n])
        pwrite_all(out_fd, view[:n], out_offset + done)
        done += n
    return h.digest(), bad


# --------------------------------------------------------------------------- index


def gather_weight_maps(
    local_map: dict[str, str], local_bytes: int, group: RunGroup | None = None
) -> tuple[list[dict[str, str]], int]:
    """All ranks' key -> file maps (indexed by rank) and the total tensor bytes.

    Only the index travels, never tensors. Every rank gets the result; rank 0 uses it.
    """
    gathered = all_gather_object((local_map, int(local_bytes)), group=group)
    return [m for m, _ in gathered], sum(b for _, b in gathered)


def write_index(
    out_dir: Path | str, weight_maps: list[dict[str, str]], total_size: int, *, rename: bool = True
) -> dict[str, str]:
    """Merge per-rank maps, rename shards to ``model-{i:05d}-of-{n:05d}.safetensors``, write the index.

    Call on rank 0 only. Files are numbered in rank order, then by name within a rank, so the
    result is deterministic. Returns the final key -> file map (as written to the index).
    """
    out_dir = Path(out_dir)
    merged, files = _merge_weight_maps(weight_maps)
    missing = [f for f in files if not (out_dir / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} shard file(s) listed in the weight maps are missing from {out_dir}, e.g. "
            f"{missing[0]}; all ranks must write to a filesystem that rank 0 sees"
        )
    if rename:
        new_names = _rename_shards(out_dir, files)
        merged = {key: new_names[fname] for key, fname in merged.items()}
    index = {"metadata": {"total_size": int(total_size)}, "weight_map": dict(sorted(merged.items()))}
    write_json_atomic(out_dir / INDEX_NAME, index)
    return index["weight_map"]


def _merge_weight_maps(weight_maps: list[dict[str, str]]) -> tuple[dict[str, str], list[str]]:
    """(key -> file over all ranks, every file in rank order): a key or a file of two ranks is refused."""
    merged: dict[str, str] = {}
    owner_of_key: dict[str, int] = {}
    owner_of_file: dict[str, int] = {}
    files: list[str] = []
    for rank, wmap in enumerate(weight_maps):
        for key, fname in wmap.items():
            if key in merged:
                raise ValueError(
                    f"tensor {key!r} was written twice: by rank {owner_of_key[key]} in {merged[key]} "
                    f"and by rank {rank} in {fname}"
                )
            merged[key] = fname
            owner_of_key[key] = rank
        for fname in sorted(set(wmap.values())):
            if fname in owner_of_file:
                raise ValueError(
                    f"shard file {fname} is listed by rank {owner_of_file[fname]} and rank {rank}; "
                    "each rank must write its own files (ShardWriter(rank=...))"
                )
            owner_of_file[fname] = rank
            files.append(fname)
    if not files:
        raise ValueError("no tensors were written on any rank; refusing to write an empty index")
    return merged, files


def _rename_shards(out_dir: Path, files: list[str]) -> dict[str, str]:
    """Rename ``files`` (in order) to ``model-{i:05d}-of-{n:05d}.safetensors``; return old -> new name."""
    n = len(files)
    new_names = {old: f"model-{i:05d}-of-{n:05d}.safetensors" for i, old in enumerate(files, start=1)}
    # Two phases, so a new name can never clobber a file not yet renamed.
    staged = {old: f".{new}.renaming" for old, new in new_names.items()}
    for old, stage in staged.items():
        (out_dir / old).rename(out_dir / stage)
    for old, stage in staged.items():
        (out_dir / stage).rename(out_dir / new_names[old])
    return new_names
