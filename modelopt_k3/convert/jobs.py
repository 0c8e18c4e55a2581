"""What a conversion does, decided before any tensor is read: per-module jobs and the plan that holds them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint import CheckpointReader, TensorInfo
from ..checkpoint.source_check import SourceLayout
from ..checkpoint.source_decode import SourceDecode
from ..export.writer import PlannedTensor
from ..quant.decisions import DecisionTable
from ..recipe import QuantFormat
from ..spec.conversion import DecodeOp


def module_outputs(name: str, fmt: QuantFormat | None, shape: tuple[int, int]) -> tuple[PlannedTensor, ...]:
    """The tensors one converted Linear is written as (``Scheme.layout``, the model path's)."""
    if fmt is None:  # a routed expert left unquantized: decoded, written as bf16 (as the model path does)
        return (PlannedTensor(f"{name}.weight", torch.bfloat16, shape),)
    layout = fmt.scheme.layout(shape)
    return tuple(PlannedTensor(f"{name}.{suffix}", dtype, shp) for suffix, dtype, shp in layout)


@dataclass(slots=True)
class _ModuleJob:
    """One Linear whose weight is converted. ``kind``: nvfp4_cast (MXFP4 source, lossless cast),
    block_fp8_copy (a block-FP8 dense Linear whose ``fmt`` holds the source's block: its codes and scales
    written as stored, ``sources`` = (codes, scales)), quant (quantize the plain or decoded weight with ``fmt``), decode (an MXFP4, block-FP8 or INT4 routed
    expert -> its plain weight, bf16), dense_decode (a kept dense Linear stored block-FP8 -> its weight in the
    model's dtype, as the model path writes the decoded parameter; ``name`` is the weight's own name).
    ``decode``: how a block-FP8/INT4 source decodes (a ``DecodeOp`` for an expert, the dense name for
    ``SourceDecode.dense_weight``); None: plain or MXFP4-packed."""

    name: str
    kind: str
    fmt: QuantFormat | None
    sources: tuple[str, ...]  # weight_packed + weight_scale, weight (+ weight_scale_inv), or an INT4 triple
    shape: tuple[int, int]  # (out, in) of the logical weight
    group: tuple[str, ...]  # modules sharing weight_scale_2 (itself included)
    input_amax: float | None = None  # constant input amax (its group's max), when inputs are quantized
    decode: DecodeOp | str | None = None
    dtype: torch.dtype = torch.bfloat16  # a dense_decode job's output dtype

    @property
    def outputs(self) -> tuple[PlannedTensor, ...]:
        if self.kind == "dense_decode":
            return (PlannedTensor(self.name, self.dtype, self.shape),)
        return module_outputs(self.name, self.fmt, self.shape)


@dataclass
class _Plan:
    src: Path
    reader: CheckpointReader  # the source's checked headers; reads tensors with pread
    jobs: dict[str, list[str | _ModuleJob]]  # file -> copy keys and module jobs, in source order
    modules: dict[str, _ModuleJob]
    table: DecisionTable
    dtype: torch.dtype
    fingerprint: str
    source: SourceLayout  # what the shared source check found (load_pretrained runs the same one)
    decode: SourceDecode = field(default_factory=SourceDecode)  # block-FP8/INT4 sources, decoded as they load
    # file -> its stat identity (size, mtime, ctime, inode) taken before any tensor byte was read: a change
    # during or after the conversion shows in it (``state.check_source``)
    identity: dict[str, list[int] | None] = field(default_factory=dict)

    @property
    def files(self) -> list[str]:
        return self.reader.files

    @property
    def sizes(self) -> dict[str, int]:
        return self.reader.sizes

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return self.reader.headers()

    def outputs(self, file: str) -> list[PlannedTensor]:
        """Every tensor the output shard ``file`` holds, in production order."""
        out: list[PlannedTensor] = []
        for job in self.jobs[file]:
            if isinstance(job, str):
                t = self.tensors[job]
                out.append(PlannedTensor(job, t.dtype, t.shape))
            else:
                out.extend(job.outputs)
        return out
