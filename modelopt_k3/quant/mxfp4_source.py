"""Lossless NVFP4 for experts whose source checkpoint stores them MXFP4-packed.

An MXFP4 weight is already on an E2M1 grid with power-of-two block scales, so NVFP4 can hold it
exactly (FORMATS.md, "Calibration-free MXFP4 -> NVFP4"): the E2M1 codes carry over byte for byte and
only the scales are re-expressed. Re-quantizing the decoded BF16 values from their amax instead would
add a second rounding for nothing. So for MXFP4-sourced experts with an NVFP4 recipe the weight
``weight_scale_2`` is the power of two of ``shared_global_scale_for`` (shared by the projections
fused into one parameter, i.e. w1 and w3), the export casts the source bytes of this rank's experts
(read again, lazily, never another rank's; or, with packed-resident experts, the bytes the module
already holds), and the fake-quant forward uses exactly those values.
This is also what the calibration-free streaming converter writes, so both paths agree byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..checkpoint import CheckpointReader
from ..experts.packed import projection_fields
from ..numerics import mxfp4_to_nvfp4, nvfp4_dequantize, shared_global_scale_for
from ..numerics.nvfp4 import NVFP4Weight
from ..spec import ModelSpec

PACKED, SCALE = "weight_packed", "weight_scale"


class Mxfp4ExpertSource:
    """This rank's packed experts of one fused experts module: the source bytes, on demand.

    ``experts``: the global ids read. ``rows``: where they sit in the module's expert dimension (all of
    it for one process or an expert-parallel block; one shard under FSDP2, where ``gather`` joins the
    ranks' rows). Scales passed in and returned span the whole expert dimension; casts and the cached
    fake-quant values cover only ``rows``.

    The bytes come from the checkpoint (read again, lazily), or with packed-resident experts from the
    module itself (``resident``: it holds exactly these bytes, so nothing is read twice).
    """

    def __init__(
        self, source: Path | CheckpointReader, spec: ModelSpec, module_name: str, experts: range,
        rows: range | None = None, gather=None, resident: nn.Module | None = None,
    ) -> None:
        # A shared open reader (LoadInfo.source()) parses the index and shard headers once per model.
        self.reader = source if isinstance(source, CheckpointReader) else CheckpointReader(source)
        self.spec = spec
        self.module_name = module_name
        self.experts = experts
        self.rows = rows if rows is not None else range(len(experts))
        self.gather = gather
        self.resident = resident

    def full(self, local: torch.Tensor) -> torch.Tensor:
        """``[len(rows), ...]`` -> the whole expert dimension (identity unless sharded; collective then)."""
        return local if self.gather is None else self.gather(local)

    def _mine(self, global_scales: torch.Tensor) -> torch.Tensor:
        return global_scales[self.rows.start : self.rows.stop]

    def _stack(self, proj: str, suffix: str, part: slice = slice(None)) -> torch.Tensor:
        if self.resident is not None:
            codes, scales = projection_fields(self.resident, self.spec, proj, part)
            return codes if suffix == PACKED else scales
        return torch.stack([self.reader.get(f"{self.module_name}.{e}.{proj}.{suffix}") for e in self.experts[part]])

    def _projections(self, fused_param: str) -> list[str]:
        projs = [p for p in self.spec.experts.projections if p.fused_param == fused_param]
        return [p.name for p in sorted(projs, key=lambda p: p.chunk)]

    def global_scales(self, fused_param: str) -> torch.Tensor:
        """fp32, one power of two per expert (shared by the fused projections), over the whole expert dim."""
        return self.full(shared_global_scale_for(*(self._stack(p, SCALE) for p in self._projections(fused_param))))

    def cast(self, proj: str, global_scales: torch.Tensor, part: slice = slice(None)) -> NVFP4Weight:
        """Batched ``[n, out, ...]`` NVFP4 tensors of one projection for this rank's experts ``[part]``
        (all of them by default)."""
        return self.cast_counted(proj, global_scales, part)[0]

    def cast_counted(self, proj: str, global_scales: torch.Tensor, part: slice = slice(None)) -> tuple[NVFP4Weight, int]:
        """``cast`` and how many NVFP4 blocks of 16 it requantized (the rest carry the source codes)."""
        global_scales = self._mine(global_scales)[part]
        return mxfp4_to_nvfp4(self._stack(proj, PACKED, part), self._stack(proj, SCALE, part), global_scales)

    def fake_quant(
        self, fused_param: str, global_scales: torch.Tensor, dtype: torch.dtype, part: slice = slice(None)
    ) -> torch.Tensor:
        """This rank's rows ``[part]`` of the fused parameter as the export will hold them, dequantized."""
        mine = self._mine(global_scales)[part]
        parts = []
        for proj in self._projections(fused_param):
            w = self.cast(proj, global_scales, part)
            parts.append(nvfp4_dequantize(w.packed, w.block_scale, mine.view(-1, 1, 1), dtype=torch.float32))
        return torch.cat(parts, dim=1).to(dtype)
