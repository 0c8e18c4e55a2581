"""What a layerwise run keeps per rank so it can resume (``--layerwise_checkpoint_dir``), and what it trusts.

``DIR/rank{r:05d}/`` holds, after each completed layer and committed in this order: the layer's export
shards (``layer{i:05d}-r…``), its quantizer state (``quant-{i:05d}.safetensors``), the next layer's captured
inputs (``inputs-{i+1:05d}.safetensors``), then ``state.json`` (written atomically: the commit point). A
file ``state.json`` does not list is debris of an interrupted layer and is deleted on resume. The state
carries the run's fingerprint (source files' names and sizes and config.json, recipe decisions, world size
and plan, calibration tokens, export settings, the load dtype, the producer: package and layer-format
version); a resume refuses any difference, naming it. Each layer's record also holds the source's content
identity as the converter's records do: the sha256 of every tensor (or row range) the layer read, hashed as
it was read (no second pass), and the stat identity of the files it read from; a resume hashes again only
what a file whose stat identity changed holds (``touch`` or a copy costs one read of it; an edit in place with
the old size and mtime still changes the ctime) and refuses a layer whose source bytes changed, naming the
tensor. Hashing runs only with ``--layerwise_checkpoint_dir`` (a temporary directory is never resumed). Ranks may differ by one layer (a kill between two ranks' commits): all resume at the
smallest count, which is why the inputs of the last two counts stay.

Nothing in the directory is trusted unchecked (issue 42): every file a layer commits is fsynced and its
sha256 recorded in ``state.json`` before the commit point; a resume checks
every file it keeps, and each captured input before it is replayed, and the export is assembled only from
files that still match, never through a symbolic link (the directory, a rank directory or a file planted in
it). A mismatch is refused naming the file. Cost: every committed byte is read once more at the commit (from
the page cache) and once before publishing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .. import __version__
from ..export.writer import write_json_atomic
from ..files.locks import acquire_lock
from .replay import Captured, load_captured, save_captured

VERSION = 3  # state.json's layout (2: every committed file's sha256; 3: the source each layer read)
# Bump whenever what a layer writes changes (its export tensors, quantizer state or captured inputs): a resume
# never mixes layers of two formats (a checkpoint dir from before a fix would republish the old bytes).
LAYER_FORMAT_VERSION = 2
STATE = "state.json"


def producer() -> str:
    """What wrote a layerwise checkpoint, as its fingerprint records it."""
    return f"modelopt_k3 {__version__}, layer format {LAYER_FORMAT_VERSION}"
_OURS = re.compile(r"^(layer\d{5}-r\d{5}-\d{5}\.safetensors|model-r\d{5}-\d{5}\.safetensors|quant-\d{5}\.safetensors|"
                   r"inputs-\d{5}\.safetensors|spill-.*\.safetensors|\..*\.spill|\.?state\.json.*)$")


# (a record's source reads, the stat identity of the files they came from) -> what changed, or None.
SourceCheck = Callable[[dict[str, str], dict[str, list[int] | None]], str | None]


class ResumeError(ValueError):
    """A layerwise checkpoint that does not belong to this run (the message names what changed)."""


def digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:32]


def source_digest(checkpoint: Path) -> str:
    """config.json's bytes and every safetensors file's name and size: the source's shape. Its content is
    checked per layer (``LayerRecord.source``), so a ``touch`` or a copy of the checkpoint still resumes."""
    parts: list[str | bytes] = [(checkpoint / "config.json").read_bytes()]
    for f in sorted(checkpoint.glob("*.safetensors")):
        parts.append(f"{f.name}:{f.stat().st_size}")
    return digest(*parts)


def sha256_of(path: Path, chunk: int = 64 * 2**20) -> str:
    """The sha256 of a file's bytes, read in chunks (never following a link: the caller refused those)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tokens_digest(batches: list[torch.Tensor]) -> str:
    return digest(*(b.to(torch.int64).contiguous().numpy().tobytes() for b in batches), str(len(batches)))


@dataclass
class LayerRecord:
    index: int
    weight_map: dict[str, str]  # key -> shard file (this rank's part of the export)
    nbytes: int
    output_meta: dict[str, Any]  # what the layer returns, for skipping it on a resume
    files: dict[str, str] = field(default_factory=dict)  # every file it committed -> its sha256
    source: dict[str, str] = field(default_factory=dict)  # every source read (key or key[a:b]) -> its sha256
    source_files: dict[str, list[int] | None] = field(default_factory=dict)  # file read -> stat identity then


@dataclass
class RankState:
    fingerprint: dict[str, str]
    layers: list[LayerRecord] = field(default_factory=list)
    rest: LayerRecord | None = None  # the tensors outside the decoder layers (written with the last layer)

    def to_json(self) -> dict[str, Any]:
        rec = lambda r: {"index": r.index, "weight_map": r.weight_map, "nbytes": r.nbytes,  # noqa: E731
                         "output_meta": r.output_meta, "files": r.files, "source": r.source,
                         "source_files": r.source_files}
        return {"version": VERSION, "fingerprint": self.fingerprint, "layers": [rec(r) for r in self.layers],
                "rest": rec(self.rest) if self.rest else None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankState:
        rec = lambda d: LayerRecord(d["index"], d["weight_map"], d["nbytes"], d["output_meta"], d["files"],  # noqa: E731
                                    d["source"], d["source_files"])
        return cls(data["fingerprint"], [rec(d) for d in data["layers"]], rec(data["rest"]) if data["rest"] else None)


@contextmanager
def held(root: Path, rank: int) -> Iterator[None]:
    """This rank's lock on the checkpoint directory for the whole run (``files/locks``): a second run on it is
    refused naming the live one instead of both writing the same layer files; a dead run's lock is taken over."""
    root = Path(root)
    if root.is_symlink():
        raise ResumeError(f"{root} is a symbolic link; a layerwise checkpoint directory must be a real directory "
                          "this run owns (give another --layerwise_checkpoint_dir)")
    root.mkdir(parents=True, exist_ok=True)
    lock = acquire_lock(root / f".rank{rank:05d}.lock", {"kind": "layerwise checkpoint"})
    try:
        yield
    finally:
        lock.release()


class RankDir:
    """This rank's directory of a layerwise run (a resume checkpoint, or a temporary one)."""

    def __init__(self, root: Path, rank: int, fingerprint: dict[str, str]) -> None:
        self.path = Path(root) / f"rank{rank:05d}"
        for d in (Path(root), self.path):
            if d.is_symlink():  # written through, it would put this run's files into whatever it points at
                raise ResumeError(f"{d} is a symbolic link; a layerwise checkpoint directory must be a real "
                                  "directory this run owns (give another --layerwise_checkpoint_dir)")
        self.path.mkdir(parents=True, exist_ok=True)
        self.state = RankState(fingerprint)

    def load(self, source_change: SourceCheck | None = None) -> int:
        """The completed layer count an earlier run left (0: none); refuses another run's checkpoint, and
        (``source_change``: what in a record's source reads differs now, or None) a layer whose source changed."""
        f = self.path / STATE
        if not f.is_file():
            return 0
        try:
            data = json.loads(f.read_text())
        except (ValueError, UnicodeDecodeError):  # written atomically by this package: anything else was edited
            raise ResumeError(f"{f} is not the JSON this package writes (truncated or edited); remove the "
                              "directory to start over") from None
        if not isinstance(data, dict) or data.get("version") != VERSION:
            data = data if isinstance(data, dict) else {}
            raise ResumeError(f"{f}: layerwise state version {data.get('version')} (another version of modelopt_k3 "
                              f"wrote it), expected {VERSION}; remove the directory to start over")
        try:
            old = RankState.from_json(data)
        except (KeyError, TypeError):
            raise ResumeError(f"{f} is not the state this package writes (edited); remove the directory to start "
                              "over") from None
        changed = sorted(k for k in set(old.fingerprint) | set(self.state.fingerprint)
                         if old.fingerprint.get(k) != self.state.fingerprint.get(k))
        if changed:
            raise ResumeError(f"the layerwise checkpoint {self.path.parent} was written by a run with another "
                              f"{', '.join(changed)}; rerun that command, or remove the directory to start over")
        self.state = old
        self.verify()
        for record in self.records() if source_change is not None else ():
            change = source_change(record.source, record.source_files)
            if change is not None:
                what = "the tensors outside the decoder layers" if record.index < 0 else f"layer {record.index}"
                raise ResumeError(f"the source checkpoint changed since {what} was committed to {self.path}: "
                                  f"{change}; remove the layerwise checkpoint directory to start over")
        return len(old.layers)

    def verify(self) -> None:
        """Every file the state lists is a regular file (no link) with the sha256 committed for it, and no
        symbolic link sits in the directory: else ``ResumeError`` naming the file (never resumed or published)."""
        for entry in self.path.iterdir():
            if entry.is_symlink():
                raise ResumeError(f"{entry} is a symbolic link in the layerwise checkpoint, which this run never "
                                  "writes; remove it (or the directory, to start over)")
        for record in self.records():
            for name, sha in record.files.items():
                if name.startswith("inputs-"):
                    continue  # checked when replayed (``inputs``): only the last two counts' are kept
                self._check_file(name, sha)

    def _check_file(self, name: str, sha: str) -> None:
        path = self.path / name
        if path.is_symlink() or not path.is_file():
            raise ResumeError(f"{path}: committed to the layerwise checkpoint but {'a link' if path.is_symlink() else 'missing'}"
                              " now; remove the directory to start over")
        if sha256_of(path) != sha:
            raise ResumeError(f"{path} changed since it was committed (its sha256 differs: truncated or edited); "
                              "remove the directory to start over")

    def _commit_files(self, names: list[str]) -> dict[str, str]:
        """sha256 of each file (fsynced first: on disk before ``state.json`` names them)."""
        out = {}
        for name in names:
            path = self.path / name
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            out[name] = sha256_of(path)
        return out

    def roll_back(self, done: int) -> None:
        """Keep the first ``done`` layers (all ranks agree on the smallest count) and delete the rest's files."""
        if len(self.state.layers) > done:
            self.state.layers = self.state.layers[:done]
            self.state.rest = None
        keep = {STATE, *(f for r in self.records() for f in r.weight_map.values())}
        keep |= {f"quant-{r.index:05d}.safetensors" for r in self.state.layers}
        keep |= {self.inputs_name(done)} if done else set()
        for f in self.path.iterdir():
            if f.name not in keep and _OURS.match(f.name):
                f.unlink()

    def records(self) -> list[LayerRecord]:
        return self.state.layers + ([self.state.rest] if self.state.rest else [])

    @staticmethod
    def inputs_name(k: int) -> str:
        return f"inputs-{k:05d}.safetensors"

    def inputs(self, k: int) -> list[Captured]:
        f = self.path / self.inputs_name(k)
        if not f.is_file():
            raise ResumeError(f"{self.path}: the inputs of layer {k} are missing; remove the directory to start over")
        sha = next((r.files[f.name] for r in self.state.layers if f.name in r.files), None)
        if sha is not None:  # inputs this run has just captured are in memory; a resume reads committed ones
            self._check_file(f.name, sha)
        return load_captured(f)

    def commit(self, record: LayerRecord, quant_state: dict[str, torch.Tensor], next_inputs: list[Captured] | None,
               rest: LayerRecord | None = None) -> None:
        """Layer ``record.index`` done: its quantizer state and the next inputs, then the state (atomically)."""
        i = record.index
        quant = f"quant-{i:05d}.safetensors"
        save_file({k: v.detach().cpu().contiguous() for k, v in quant_state.items()}, str(self.path / quant))
        written = [*sorted(set(record.weight_map.values())), quant]
        if next_inputs is not None:
            save_captured(self.path / self.inputs_name(i + 1), next_inputs)
            written.append(self.inputs_name(i + 1))
        record.files = self._commit_files(written)
        if rest is not None:
            rest.files = self._commit_files(sorted(set(rest.weight_map.values())))
        self.state.layers.append(record)
        self.state.rest = rest
        write_json_atomic(self.path / STATE, self.state.to_json())
        (self.path / self.inputs_name(i - 1)).unlink(missing_ok=True)  # the last two counts' inputs stay
