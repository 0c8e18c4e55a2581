"""Skip / run / capture: one decoder layer replayed at a time through the model's own forward.

Every call of the model runs its own code (embeddings, masks, position embeddings, the decoder loop), so
whatever a model hands each layer (Kimi-K3's KDA or MLA mask, its AttnRes block residuals, GPT-OSS's
sliding-window mask) is what the layer gets. Layers before the current one are *skipped* (they return
placeholders shaped like their real output, which nothing reads), the current layer *runs* on the
arguments captured for it in the previous step (this batch's real inputs), and the next layer *captures*
its arguments and stops the forward. The last step lets the forward finish (final norm, ``lm_head``:
quantizers outside the layers calibrate there). Calls go with ``use_cache=False``, so no KDA recurrent
state or MLA cache exists to leak from one replay into the next.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils import _pytree as pytree


class StopForward(BaseException):  # noqa: N818 - a control-flow signal, not an error; BaseException: no model code swallows it
    """Raised by the capturing layer once its arguments are recorded."""


@dataclass
class Captured:
    """One batch's arguments of one layer: the tree of ``(args, kwargs)`` with its tensors apart."""

    spec: str  # pytree.treespec_dumps of (args, kwargs)
    tensors: list[torch.Tensor | None]  # leaf i: a tensor, or None where ``values`` holds it
    values: list[Any]  # JSON leaves (None, bool, int, float, str) at the non-tensor positions

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> Captured:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors, values = [], []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                tensors.append(leaf.detach())
                values.append(None)
            elif leaf is None or isinstance(leaf, (bool, int, float, str)):
                tensors.append(None)
                values.append(leaf)
            else:
                raise TypeError(f"a decoder layer got an argument of type {type(leaf).__name__}, which a layerwise "
                                "replay cannot keep (tensors and plain values only; is a cache being passed?)")
        return cls(pytree.treespec_dumps(spec), tensors, values)

    def call_args(self, device: torch.device) -> tuple[tuple, dict]:
        leaves = [t.to(device) if t is not None else v for t, v in zip(self.tensors, self.values)]
        return pytree.tree_unflatten(leaves, pytree.treespec_loads(self.spec))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors if t is not None)


def output_meta(output: Any) -> dict[str, Any]:
    """What a skipped layer returns in place of ``output``: its structure, each tensor's shape and dtype."""
    leaves, spec = pytree.tree_flatten(output)
    if not all(isinstance(x, torch.Tensor) for x in leaves):
        raise TypeError("a decoder layer returned something other than tensors; a layerwise replay cannot skip it")
    return {"spec": pytree.treespec_dumps(spec),
            "leaves": [[list(x.shape), str(x.dtype).removeprefix("torch.")] for x in leaves]}


def placeholder(meta: dict[str, Any], device: torch.device) -> Any:
    """Zero-strided stand-ins of a layer's output (no memory): what a skipped layer hands on, never read."""
    leaves = [torch.zeros((), dtype=getattr(torch, dtype), device=device).expand(shape) for shape, dtype in meta["leaves"]]
    return pytree.tree_unflatten(leaves, pytree.treespec_loads(meta["spec"]))


class LayerReplay:
    """The decoder layers of ``model``, patched (an instance ``forward``) to skip, run cached inputs or capture."""

    def __init__(self, model: nn.Module, layers: list[str], device: torch.device) -> None:
        self.model, self.names, self.device = model, layers, device
        self.modules = [model.get_submodule(n) for n in layers]
        self.metas: list[dict[str, Any] | None] = [None] * len(layers)
        self.current = -1  # the layer that runs; -1: only capture layer 0
        self.capture = True
        self._inputs: Captured | None = None
        self._captured: Captured | None = None
        self.output: torch.Tensor | None = None  # the last step's output of layer ``current`` (its first tensor)
        self.result: Any = None  # the last step's model output (its logits), when the forward ran to the end
        self._originals = [m.forward for m in self.modules]
        for i, module in enumerate(self.modules):
            module.forward = self._patched(i)

    def restore(self) -> None:
        for module, forward in zip(self.modules, self._originals):
            module.forward = forward

    def _patched(self, i: int):
        original = self._originals[i]

        def forward(*args, **kwargs):
            if i < self.current:
                if self.metas[i] is None:
                    raise RuntimeError(f"layer {i} is skipped but was never run (no output structure known)")
                return placeholder(self.metas[i], self.device)
            if i == self.current:
                args, kwargs = self._inputs.call_args(self.device)
                out = original(*args, **kwargs)
                self.metas[i] = output_meta(out)
                self.output = out[0] if isinstance(out, tuple) else out
                if not self.capture and i + 1 < len(self.modules):
                    raise StopForward  # nothing to capture: the layers after it are not needed
                return out
            if self.capture and i == self.current + 1:
                self._captured = Captured.of(args, kwargs)
                raise StopForward
            raise RuntimeError(f"layer {i} was reached while layer {self.current} is replayed: the forward should "
                               "have stopped")

        return forward

    @torch.no_grad()
    def step(self, batch: torch.Tensor, inputs: Captured | None) -> Captured | None:
        """One forward of ``batch`` with layer ``current`` run on ``inputs``; returns the next layer's
        arguments (when capturing and a next layer exists). ``output`` then holds the layer's output, and
        ``result`` the model's output when the forward ran to its end (the last layer), else None."""
        self._inputs, self._captured, self.output, self.result = inputs, None, None, None
        try:
            self.result = self.model(input_ids=batch.to(self.device), use_cache=False)
        except StopForward:
            pass
        finally:
            self._inputs = None
        return self._captured


# --------------------------------------------------------------------------- the cache of captured inputs


class InputCache:
    """The captured arguments of one layer, one entry per batch, in host memory until ``limit_bytes``, then
    spilled to safetensors files in ``spill_dir`` (read back when replayed)."""

    def __init__(self, spill_dir: Path, limit_bytes: int, tag: str) -> None:
        self.spill_dir, self.limit, self.tag = spill_dir, limit_bytes, tag
        self.entries: list[Captured | Path] = []
        self.host_bytes = 0

    def append(self, item: Captured) -> None:
        item = Captured(item.spec, [t.cpu() if t is not None else None for t in item.tensors], item.values)
        if self.host_bytes + item.nbytes > self.limit:
            path = self.spill_dir / f"spill-{self.tag}-{len(self.entries):05d}.safetensors"
            save_captured(path, [item])
            self.entries.append(path)
        else:
            self.entries.append(item)
            self.host_bytes += item.nbytes

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> Captured:
        entry = self.entries[i]
        return load_captured(entry)[0] if isinstance(entry, Path) else entry

    def discard(self) -> None:
        for entry in self.entries:
            if isinstance(entry, Path):
                entry.unlink(missing_ok=True)
        self.entries = []


def save_captured(path: Path, items: list[Captured]) -> None:
    """Captured arguments as one safetensors file: tensors ``{batch}/{leaf}``, the trees and plain values in
    the metadata (JSON; never pickle)."""
    # Copies: safetensors refuses tensors sharing memory (one mask handed to several arguments, say).
    tensors = {f"{b}/{j}": t.clone() for b, item in enumerate(items) for j, t in enumerate(item.tensors)
               if t is not None}
    meta = [{"spec": item.spec, "values": item.values, "tensors": [t is not None for t in item.tensors]}
            for item in items]
    save_file(tensors, str(path), metadata={"modelopt_k3.layerwise": json.dumps(meta)})


def load_captured(path: Path) -> list[Captured]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["modelopt_k3.layerwise"])
    tensors = load_file(str(path))
    return [Captured(m["spec"], [tensors[f"{b}/{j}"] if has else None for j, has in enumerate(m["tensors"])],
                     m["values"]) for b, m in enumerate(meta)]
