"""What a layerwise run keeps per rank so it can resume (``--layerwise_checkpoint_dir``), and what it trusts.

``DIR/rank{r:05d}/`` holds, after each completed layer and committed in this order: the layer's export
shards (``layer{i:05d}-r…``), its quantizer state (``quant-{i:05d}.safetensors``), the next layer's captured
inputs (``inputs-{i+1:05d}.safetensors``), then ``state.json`` (written atomically: the commit point). A
file ``state.json`` does not list is debris of an interrupted layer and is deleted on resume. The state
carries the run's fingerprint (source files, recipe decisions, world size and plan, calibration tokens,
export settings); a resume refuses any difference, naming it. Ranks may differ by one layer (a kill between
two ranks' commits): all resume at the smallest count, which is why the inputs of the last two counts stay.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..export.writer import write_json_atomic
from .replay import Captured, load_captured, save_captured

VERSION = 1
STATE = "state.json"
_OURS = re.compile(r"^(layer\d{5}-r\d{5}-\d{5}\.safetensors|model-r\d{5}-\d{5}\.safetensors|quant-\d{5}\.safetensors|"
                   r"inputs-\d{5}\.safetensors|spill-.*\.safetensors|\..*\.spill|\.?state\.json.*)$")


class ResumeError(ValueError):
    """A layerwise checkpoint that does not belong to this run (the message names what changed)."""


def digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:32]


def source_digest(checkpoint: Path) -> str:
    """config.json's bytes and every safetensors file's name, size and modification time."""
    parts: list[str | bytes] = [(checkpoint / "config.json").read_bytes()]
    for f in sorted(checkpoint.glob("*.safetensors")):
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return digest(*parts)


def tokens_digest(batches: list[torch.Tensor]) -> str:
    return digest(*(b.to(torch.int64).contiguous().numpy().tobytes() for b in batches), str(len(batches)))


@dataclass
class LayerRecord:
    index: int
    weight_map: dict[str, str]  # key -> shard file (this rank's part of the export)
    nbytes: int
    output_meta: dict[str, Any]  # what the layer returns, for skipping it on a resume


@dataclass
class RankState:
    fingerprint: dict[str, str]
    layers: list[LayerRecord] = field(default_factory=list)
    rest: LayerRecord | None = None  # the tensors outside the decoder layers (written with the last layer)

    def to_json(self) -> dict[str, Any]:
        rec = lambda r: {"index": r.index, "weight_map": r.weight_map, "nbytes": r.nbytes,  # noqa: E731
                         "output_meta": r.output_meta}
        return {"version": VERSION, "fingerprint": self.fingerprint, "layers": [rec(r) for r in self.layers],
                "rest": rec(self.rest) if self.rest else None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankState:
        rec = lambda d: LayerRecord(d["index"], d["weight_map"], d["nbytes"], d["output_meta"])  # noqa: E731
        return cls(data["fingerprint"], [rec(d) for d in data["layers"]], rec(data["rest"]) if data["rest"] else None)


class RankDir:
    """This rank's directory of a layerwise run (a resume checkpoint, or a temporary one)."""

    def __init__(self, root: Path, rank: int, fingerprint: dict[str, str]) -> None:
        self.path = Path(root) / f"rank{rank:05d}"
        self.path.mkdir(parents=True, exist_ok=True)
        self.state = RankState(fingerprint)

    def load(self) -> int:
        """The completed layer count an earlier run left (0: none); refuses another run's checkpoint."""
        f = self.path / STATE
        if not f.is_file():
            return 0
        data = json.loads(f.read_text())
        if data.get("version") != VERSION:
            raise ResumeError(f"{f}: layerwise state version {data.get('version')}, expected {VERSION}")
        old = RankState.from_json(data)
        changed = sorted(k for k in set(old.fingerprint) | set(self.state.fingerprint)
                         if old.fingerprint.get(k) != self.state.fingerprint.get(k))
        if changed:
            raise ResumeError(f"the layerwise checkpoint {self.path.parent} was written by a run with another "
                              f"{', '.join(changed)}; rerun that command, or remove the directory to start over")
        self.state = old
        return len(old.layers)

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
        return load_captured(f)

    def commit(self, record: LayerRecord, quant_state: dict[str, torch.Tensor], next_inputs: list[Captured] | None,
               rest: LayerRecord | None = None) -> None:
        """Layer ``record.index`` done: its quantizer state and the next inputs, then the state (atomically)."""
        i = record.index
        save_file({k: v.detach().cpu().contiguous() for k, v in quant_state.items()},
                  str(self.path / f"quant-{i:05d}.safetensors"))
        if next_inputs is not None:
            save_captured(self.path / self.inputs_name(i + 1), next_inputs)
        self.state.layers.append(record)
        self.state.rest = rest
        write_json_atomic(self.path / STATE, self.state.to_json())
        (self.path / self.inputs_name(i - 1)).unlink(missing_ok=True)  # the last two counts' inputs stay
