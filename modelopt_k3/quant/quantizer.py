"""``TensorQuantizer``: calibration state (amax) plus a fake-quant forward that uses the export numerics.

One quantizer serves one tensor role (a Linear's weight, a Linear's input, or one projection of a
fused experts module, where ``amax`` has one entry per local expert). Modes:

* ``calib``: record ``amax`` (running max of ``|x|``), return ``x`` unchanged;
* ``quant``: return ``dequantize(quantize(x))`` computed by ``modelopt_k3.numerics`` -- exactly what
  the exported checkpoint will hold, so the fake-quantized model and the export agree;
* ``off``: identity.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from ..dist.fsdp import full_amax
from .schemes import TensorFormat

Mode = Literal["off", "calib", "quant"]


class QuantizerError(RuntimeError):
    pass


class TensorQuantizer(nn.Module):
    """Quantizer for one tensor role; ``amax`` is a buffer (scalar, or ``[E]`` per expert)."""

    def __init__(
        self, fmt: TensorFormat, *, role: Literal["weight", "input"], amax_shape: tuple[int, ...] = (),
        constant_amax: float | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(fmt, TensorFormat):
            raise QuantizerError(f"format {fmt!r} is not a registry format (modelopt_k3.quant.schemes)")
        self.fmt = fmt
        self.role = role
        self.mode: Mode = "off"
        self.constant_amax = constant_amax
        self.register_buffer("amax", torch.full(amax_shape, float("nan"), dtype=torch.float32))
        if constant_amax is not None:
            self.amax.fill_(constant_amax)
        # Set for weights cast losslessly from an MXFP4 source (quant/mxfp4_source.py): the scale is
        # the source's power of two, not amax-derived, and fake quant is the cast, dequantized.
        # ``fixed_scale`` alone: a per-tensor scale a calibrator chose (four-over-six's amax / (6*256)).
        self.source = None
        # Set for a dense weight written as its block-FP8 source bytes (quant/block_fp8_source.py): the export
        # copies them and fake quant is their decode. An updated weight (below) is quantized instead.
        self.block_source = None
        self.register_buffer("fixed_scale", None)
        # NVFP4 weights only: e4m3 block scales a weight calibrator chose (quant/calibrators), used by
        # fake quant and export instead of the amax-derived ones; None under max.
        self.register_buffer("block_scale", None)
        # The weight a weight-updating calibrator (GPTQ) wrote, quantized and exported in place of the module's
        # own (which stays the original, for the report and the KL reference): ``[out, in]`` for a dense
        # Linear, ``[E, out, in]`` over the module's expert dim for fused experts.
        self.register_buffer("updated_weight", None)
        self._fake_cache: torch.Tensor | None = None
        # Activation counters of the quantization report (quant/activation_stats.py), for input roles.
        self.stats = None

    def use_source(self, source, fused_param: str) -> None:
        self.source = (source, fused_param)
        self.fixed_scale = source.global_scales(fused_param).to(self.amax.device)

    def extra_repr(self) -> str:
        amax = "unset" if not self.calibrated else f"{self.amax.max().item():.4g}"
        const = " (constant)" if self.constant_amax is not None else ""
        return f"{self.role} {self.fmt}, mode={self.mode}, amax={amax}{const}"

    @property
    def calibrated(self) -> bool:
        return self.fixed_scale is not None or bool(torch.isfinite(self.amax).all())

    def reset(self) -> None:
        self.amax.fill_(float("nan") if self.constant_amax is None else self.constant_amax)

    @torch.no_grad()
    def observe(self, x: torch.Tensor, reduce_dims: tuple[int, ...] | None = None) -> None:
        """Fold ``max|x|`` into ``amax`` (over ``reduce_dims``, all dims when None).

        An FSDP2-sharded ``x`` gives the amax of the full tensor (a collective: every rank calls it).
        """
        if self.constant_amax is not None:
            return
        self.fold_amax(full_amax(x, reduce_dims))

    @torch.no_grad()
    def fold_amax(self, value: torch.Tensor) -> None:
        """Fold an amax measured elsewhere (e.g. from packed weight blocks) into ``amax``."""
        if self.constant_amax is not None:
            return
        value = value.to(self.amax.device)
        # NaN in amax means "never observed": an observed NaN becomes +Inf, which every max keeps
        # (across batches and ranks), so calibrate() can tell "not a number" from "no data".
        value = torch.where(torch.isnan(value), torch.inf, value)
        self.amax.copy_(torch.where(torch.isnan(self.amax), value, torch.maximum(self.amax, value)))

    @property
    def saw_nonfinite(self) -> bool:
        """Whether calibration observed NaN/Inf here (amax +Inf; see ``observe``)."""
        return bool(torch.isinf(self.amax).any())

    def scale(self) -> torch.Tensor:
        """The per-tensor scale the export writes (``weight_scale_2``/``input_scale``/FP8 ``scale``)."""
        if self.fixed_scale is not None:
            return self.fixed_scale
        if not self.calibrated:
            raise QuantizerError(f"{self.role} quantizer ({self.fmt}) has no amax: it was never calibrated")
        return self.fmt.scale(self.amax)

    def fake_quant(self, x: torch.Tensor, *, expert_dim: bool = False, rows: slice | None = None) -> torch.Tensor:
        """Quantize-dequantize ``x``. ``expert_dim``: ``x`` is ``[E, out, in]`` with one amax per expert;
        ``rows``: ``x`` holds only those local experts (packed experts decode a chunk at a time)."""
        if self.source is not None:
            source, param = self.source
            if rows is not None:  # a decoded chunk: computed from the resident bytes, never cached
                return source.fake_quant(param, self.scale(), dtype=x.dtype, part=rows).to(x.device)
            if self._fake_cache is None or self._fake_cache.dtype != x.dtype:
                self._fake_cache = source.fake_quant(param, self.scale(), dtype=x.dtype).to(x.device)
            return source.full(self._fake_cache)  # this rank's rows, gathered when the weight is sharded
        if self.passes_through:
            return self.block_source.fake_quant(x)
        if not self.fmt.per_tensor_scale:  # block scales: nothing observed, each block its own scale
            return self.fmt.fake_quant(x, None)
        x = self.weight_to_quantize(x, experts=(rows if rows is not None else slice(None)) if expert_dim else None)
        scale = self.scale()
        if expert_dim:
            scale = (scale if rows is None else scale[rows]).view(-1, 1, 1)
        return self.fmt.fake_quant(x, scale.to(x.device), **self.searched_scales(rows if expert_dim else None))

    @property
    def passes_through(self) -> bool:
        """Whether this weight is written as its block-FP8 source bytes (no weight update replaced it)."""
        return self.block_source is not None and self.updated_weight is None

    def weight_to_quantize(self, weight: torch.Tensor, experts: slice | None = None) -> torch.Tensor:
        """``weight``, or the calibrator's updated weight (same shape and dtype) when there is one.
        ``experts``: ``weight`` holds those experts (an index range into the module's expert dim)."""
        if self.updated_weight is None:
            return weight
        updated = self.updated_weight if experts is None else self.updated_weight[experts]
        if updated.shape != weight.shape:
            raise QuantizerError(f"the updated weight {tuple(updated.shape)} does not match the weight "
                                 f"{tuple(weight.shape)} it replaces")
        return updated.to(device=weight.device, dtype=weight.dtype)

    def searched_scales(self, experts: slice | int | None = None, chunk: tuple[int, int] | None = None) -> dict:
        """``{"block_scale": ...}`` for the format's ``fake_quant``/``weight_tensors`` when a calibrator
        chose block scales (else ``{}``: the format derives them). ``experts``: those experts' scales
        (index into the expert dim); ``chunk``: ``(i, n)``, the i-th of n row chunks (a fused projection)."""
        bs = self.block_scale
        if bs is None:
            return {}
        if experts is not None:
            bs = bs[experts]
        if chunk is not None:
            bs = bs.chunk(chunk[1], dim=-2)[chunk[0]]
        return {"block_scale": bs}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stats is not None and self.mode != "off":
            self.stats.update(self, x)
        if self.mode == "calib":
            self.observe(x)
            return x
        if self.mode == "quant":
            return self.fake_quant(x)
        return x
