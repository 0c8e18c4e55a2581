"""``LayerwiseLoad``: a planned load one decoder layer at a time (``--layerwise``; ``modelopt_k3.layerwise`` drives it).

It is the resident load's pieces (``pretrained``: the placed model on meta, this rank's reads, the read log)
applied to one ``LoadScope`` at a time, plus the release of a layer's tensors back to meta after its export.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm.auto import tqdm

from ..checkpoint import CheckpointError
from ..checkpoint.reader import parse_read
from ..checkpoint.source_decode import decoded_dense
from ..dist.collectives import run_together
from ..dist.group import current_group
from ..files.paths import stat_identity
from ..spec.names import enclosing, under_any
from .pretrained import (
    LoadError,
    LoadInfo,
    LoadScope,
    _build_placed_on_meta,
    _fill_own,
    _names,
    _planned_source,
    _prepare,
    _record_reads,
    _register_dispatch,
    carried_fields,
    materialize,
    persistent_tensors,
    tie_as_stored,
)

if TYPE_CHECKING:
    from ..run.plan import RunPlan

__all__ = ["LayerwiseLoad", "is_quantizer_state", "keys_by_layer", "release_tensors"]


def keys_by_layer(names, layers: list[str]) -> dict[str | None, tuple[str, ...]]:
    """Source keys grouped by the decoder layer whose name prefixes them (None: outside every layer)."""
    wanted = set(layers)
    grouped: dict[str | None, list[str]] = {name: [] for name in layers}
    grouped[None] = []
    for key in names:
        grouped[enclosing(key, wanted.__contains__)].append(key)
    return {layer: tuple(keys) for layer, keys in grouped.items()}


class LayerwiseLoad:
    """A planned load one decoder layer at a time (``--layerwise``; ``modelopt_k3.layerwise`` drives it).

    The placed model is built on meta and checked against the headers as ``load_planned`` does; what lies
    outside the decoder layers (embeddings, final norm, ``lm_head``, the vision tower) is materialised and
    read at once; ``read_layer`` materialises and reads one layer (this rank's experts and dense tensors,
    nothing else), ``release_layer`` returns its tensors to meta. ``finish`` refuses source tensors no read
    consumed, as a resident load does at its end.
    """

    def __init__(self, run: RunPlan, *, progress: bool = True, hash_reads: bool = False) -> None:
        group = current_group()
        why = run.distribution.layerwise_refusal()
        if why is not None:
            raise ValueError(why)
        src = run_together("load: check the checkpoint", _planned_source, run, group=group)
        plan = run.distribution
        _register_dispatch(plan)
        placement = plan.build_placement()
        self._converters = _prepare(src, run.checkpoint, plan)
        model = _build_placed_on_meta(src, plan, placement, run.dtype, group)
        self.model, self.reader, self.progress = model, src.reader, progress
        self.checkpoint = Path(run.checkpoint)
        # The source's content identity for a resumable run (``take_reads``): taken before any byte is read.
        self._identity = {f: stat_identity(self.checkpoint / f) for f in src.reader.files} if hash_reads else {}
        if hash_reads:
            src.reader.log.hashes = {}
        self.layers = list(src.spec.decoder_layers(model))
        if not self.layers:
            raise ValueError(f"model_type {src.spec.model_type} names no decoder layers (ReportSpec.decoder_layer_regex)")
        carried = src.layout.carried_keys  # modules the model does not build (MTP layers): the export writes them
        read = [k for k in src.reader.names() if k not in carried]
        self._keys = keys_by_layer(read, self.layers)
        self._consumed: set[str] = set(carried)
        self._allow_nonfinite = run.config.allow_nonfinite_passthrough
        self.info = LoadInfo(checkpoint=run.checkpoint, spec=src.spec, plan=plan, placement=placement,
                             model_cls=src.model_cls, packed_experts=src.layout.packed_experts, _source=src.reader,
                             **carried_fields(src.layout, src.reader, src.spec, self._converters, src.config,
                                              run.dtype))
        # Every dense name a source format decodes, from the headers, before any layer is read: the export's
        # items (``ExportInParts``) are listed up front and must write those from the model, not copy the keys.
        self.info.decoded_dense.update(decoded_dense(src.reader, src.spec.loading.dense_converters, read))
        outside = LoadScope(("",), tuple(self.layers), self._keys[None])
        materialize(model, plan.device, outside)
        tie_as_stored(model, src.reader)
        self._read(outside, "outside the decoder layers")
        model.eval()
        model.modelopt_k3 = self.info

    def read_layer(self, name: str) -> None:
        scope = LoadScope((name,), keys=self._keys[name])
        materialize(self.model, self.info.plan.device, scope)
        self._read(scope, name)

    def release_layer(self, name: str) -> None:
        """Every persistent tensor of layer ``name`` back to meta; quantizers (``is_quantizer_state``) keep theirs."""
        release_tensors(self.model.get_submodule(name))

    def skip_layer(self, name: str) -> None:
        """A layer whose export an earlier run completed (a resume): its source keys count as consumed."""
        self._consumed.update(self._keys[name])

    def take_reads(self) -> tuple[dict[str, str], dict[str, list[int] | None]]:
        """The sha256 of every source read since the last call (key, or ``key[a:b]`` for rows) and the stat
        identity of their files before the run read them: what a layer's record keeps (empty unless hashing)."""
        log = self.reader.log
        if log.hashes is None:
            return {}, {}
        reads, log.hashes = log.hashes, {}
        files = {self.reader.info(parse_read(r)[0]).file for r in reads}
        return reads, {f: self._identity[f] for f in sorted(files)}

    def source_change(self, reads: dict[str, str], identity: dict[str, list[int] | None]) -> str | None:
        """What of ``reads`` (a committed layer's) differs in the source now, or None: only the files whose
        stat identity changed are read again (the converter's rule, ``convert/state.check_source``)."""
        suspect = {f for f, ident in identity.items() if stat_identity(self.checkpoint / f) != ident}
        if not suspect:
            return None
        with self.reader:
            for read, sha in sorted(reads.items()):
                key = parse_read(read)[0]
                try:
                    info = self.reader.info(key)
                except CheckpointError:
                    return f"tensor {key} is gone"
                if info.file in suspect and self.reader.sha256(read) != sha:
                    return f"tensor {key} in {info.file} no longer holds the bytes that layer read"
        return None

    def finish(self) -> None:
        unexpected = set(self.reader.names()) - self._consumed
        if unexpected:
            raise LoadError(f"checkpoint tensors the model has no place for: {_names(unexpected)}")

    def _read(self, scope: LoadScope, what: str) -> None:
        run_together(f"load {what}", self._read_scope, scope, what, group=current_group())

    def _read_scope(self, scope: LoadScope, what: str) -> None:
        reader, model = self.reader, self.model
        tensors = [n for n in persistent_tensors(model) if scope.holds(n)]
        with reader, tqdm(total=len(tensors), desc=f"load {what}", disable=not self.progress, leave=False) as bar:
            self._consumed |= _fill_own(model, reader, self._converters, self.info, bar, scope)
        _record_reads(self.info, reader, self._allow_nonfinite, scope.keys)


def is_quantizer_state(module: nn.Module) -> bool:
    """Quantizer modules: what calibration decided, kept when a layer's weights are released."""
    from ..quant.modules import ExpertsQuantState
    from ..quant.quantizer import TensorQuantizer

    return isinstance(module, (TensorQuantizer, ExpertsQuantState))


def release_tensors(root: nn.Module) -> None:
    """Replace every parameter and persistent buffer under ``root`` (not under a quantizer) by a meta tensor."""
    skip: list[str] = []
    for name, module in root.named_modules():
        if under_any(name, skip):
            continue
        if is_quantizer_state(module):
            skip.append(name)
            continue
        for pname, param in list(module._parameters.items()):
            if param is not None and not param.is_meta:
                module._parameters[pname] = nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
        for bname, buf in list(module._buffers.items()):
            if buf is not None and not buf.is_meta and bname not in module._non_persistent_buffers_set:
                module._buffers[bname] = torch.empty_like(buf, device="meta")
