"""Streaming, atomic checkpoint writing; no rank ever holds or sends the whole model.

Typical use on every rank::

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
import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from modelopt_k3.checkpoint import _ST_DTYPES
from modelopt_k3.dist.collectives import (
    DistributedStepError,
    all_gather_object,
    broadcast_object,
    run_together,
)
from modelopt_k3.dist.group import RunGroup, current_group
from modelopt_k3.export.staging import StagingDir, remove_tree, sweep_stale

__all__ = [
    "INDEX_FILE",
    "ShardWriter",
    "atomic_output_dir",
    "gather_weight_maps",
    "write_index",
]

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
# Buffered bytes above which a shard's tensors go to its spill file (bounds export memory).
DEFAULT_SPILL_BYTES = 256 * 2**20
_ST_DTYPE_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}


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
    tmp = Path(broadcast_object(None if staging is None else str(staging.path), src=0, group=g))
    published = False
    interrupted = False
    try:
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
            elif interrupted:
                remove_tree(tmp)  # rank 0 may be the rank that was killed


def _reraise(exc: BaseException) -> None:
    raise exc


# --------------------------------------------------------------------------- shard writer


class ShardWriter:
    """Buffer tensors and write safetensors shards of at most ``max_shard_bytes`` each.

    Memory stays bounded by ``spill_bytes`` (plus one tensor): once a shard's buffered tensors pass
    it, their bytes go to a spill file next to the shard, and the shard is assembled from it (header,
    then the spilled bytes) when it is full. A shard that never spills is written by safetensors'
    own ``save_file``. A tensor larger than the limit gets a shard of its own. File names are
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
        self._buffer_storages: set[int] = set()
        self._closed = False
        self.spill_bytes = spill_bytes
        self._spilled: list[tuple[str, str, list[int], int]] = []  # name, dtype, shape, nbytes (in order)
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

        t = tensor.detach().to("cpu")
        storage = t.untyped_storage()
        # safetensors refuses views and tensors sharing memory: copy those (e.g. slices of a fused weight).
        if (
            not t.is_contiguous()
            or t.storage_offset() != 0
            or storage.nbytes() != t.nbytes
            or storage.data_ptr() in self._buffer_storages
        ):
            t = t.clone(memory_format=torch.contiguous_format)
            storage = t.untyped_storage()
        if (self._buffer or self._spilled) and self._buffer_bytes + t.nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = t
        self._buffer_storages.add(storage.data_ptr())
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
            self._spill_file = open(self._spill_path(), "wb")  # noqa: SIM115 - closed in _flush/__exit__
        for name, t in self._buffer.items():
            self._spill_file.write(t.reshape(-1).view(torch.uint8).numpy().data)
            self._spilled.append((name, _ST_DTYPE_NAMES[t.dtype], list(t.shape), t.nbytes))
        self._buffer, self._buffer_storages = {}, set()

    def _flush_spilled(self, path: Path) -> None:
        """Assemble a shard from its spill file: 8-byte header length, JSON header, tensor bytes."""
        self._spill()
        self._spill_file.close()
        header: dict[str, object] = {"__metadata__": self.metadata}
        offset = 0
        for name, dtype, shape, nbytes in self._spilled:
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
        spill = self._spill_path()
        with open(path, "wb") as out, open(spill, "rb") as data:
            out.write(struct.pack("<Q", len(raw)) + raw)
            shutil.copyfileobj(data, out, length=64 * 2**20)
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
            save_file(self._buffer, str(path), metadata=self.metadata)
        self.num_shards += 1
        self._buffer = {}
        self._buffer_storages = set()
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
            self._buffer, self._buffer_storages, self._closed = {}, set(), True
            if self._spill_file is not None:
                self._spill_file.close()
                self._spill_path().unlink(missing_ok=True)
                self._spill_file, self._spilled = None, []


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
    missing = [f for f in files if not (out_dir / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} shard file(s) listed in the weight maps are missing from {out_dir}, e.g. "
            f"{missing[0]}; all ranks must write to a filesystem that rank 0 sees"
        )

    if rename:
        n = len(files)
        new_names = {old: f"model-{i:05d}-of-{n:05d}.safetensors" for i, old in enumerate(files, start=1)}
        # Two phases, so a new name can never clobber a file not yet renamed.
        staged = {old: f".{new}.renaming" for old, new in new_names.items()}
        for old, stage in staged.items():
            (out_dir / old).rename(out_dir / stage)
        for old, stage in staged.items():
            (out_dir / stage).rename(out_dir / new_names[old])
        merged = {key: new_names[fname] for key, fname in merged.items()}

    index = {"metadata": {"total_size": int(total_size)}, "weight_map": dict(sorted(merged.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return index["weight_map"]
