"""``LayerwiseLoad``: a planned load one decoder layer at a time (``--layerwise``; ``modelopt_k3.layerwise`` drives it).

It is the resident load with another residency: the same ``pretrained.build_planned`` (the placed model on
meta, checked against the headers) and ``read_scope`` (this rank's reads, the read log), applied to one
``LoadScope`` at a time, plus the release of a layer's tensors back to meta after its export.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..checkpoint import CheckpointError
from ..checkpoint.reader import parse_read
from ..checkpoint.source_decode import decoded_dense
from ..files.paths import stat_identity
from ..spec.names import enclosing, under_any
from .pretrained import LoadScope, build_planned, materialize, read_scope, tie_as_stored

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
        why = run.distribution.layerwise_refusal()
        if why is not None:
            raise ValueError(why)
        self.build = build = build_planned(run)
        model, reader, info = build.model, build.reader, build.info
        self.model, self.reader, self.info, self.progress = model, reader, info, progress
        self.checkpoint = Path(run.checkpoint)
        # The source's content identity for a resumable run (``take_reads``): taken before any byte is read.
        self._identity = {f: stat_identity(self.checkpoint / f) for f in reader.files} if hash_reads else {}
        if hash_reads:
            reader.log.hashes = {}
        self.layers = list(info.spec.decoder_layers(model))
        if not self.layers:
            raise ValueError(f"model_type {info.spec.model_type} names no decoder layers (ReportSpec.decoder_layer_regex)")
        carried = info.carried_keys  # modules the model does not build (MTP layers): the export writes them
        read = [k for k in reader.names() if k not in carried]
        self._keys = keys_by_layer(read, self.layers)
        self._consumed: set[str] = set(carried)
        self._allow_nonfinite = run.config.allow_nonfinite_passthrough
        # Every dense name a source format decodes, from the headers, before any layer is read: the export's
        # items (``ExportInParts``) are listed up front and must write those from the model, not copy the keys.
        info.decoded_dense.update(decoded_dense(reader, info.spec.loading.dense_converters, read))
        outside = LoadScope(("",), tuple(self.layers), self._keys[None])
        materialize(model, info.plan.device, outside)
        tie_as_stored(model, reader)
        self._read(outside, "outside the decoder layers")
        model.eval()
        model.modelopt_k3 = info

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
        self.build.refuse_unconsumed(self._consumed)

    def _read(self, scope: LoadScope, what: str) -> None:
        self._consumed |= read_scope(self.build, scope, allow_nonfinite_passthrough=self._allow_nonfinite,
                                     progress=self.progress, what=what)


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
