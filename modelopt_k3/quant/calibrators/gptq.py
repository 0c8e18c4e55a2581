"""``gptq``: max, then every dense NVFP4 Linear's weight updated by GPTQ under max's fixed scales
(numerics/gptq.py; ModelOpt 0.47 ``gptq`` with ``layerwise: {enable: false}``).

The Hessian ``2/n * sum x xᵀ`` comes from one more forward of the resident model with activations
fake-quantized and weights not (each Linear's input after its own input quantizer, as ModelOpt's
hook takes it), summed over ranks in float64. Layer by layer (``modelopt_k3.layerwise``, ModelOpt's
``layerwise: {enable: true}``) each layer's inputs come from the quantized layers before it. Not built: GPTQ of routed experts
(their per-expert inputs need an owner-side hook; they keep max's scales and say so in the labels).
The updated weight lives in the quantizer (``updated_weight``): fake quant and export use it, the
module keeps the original (the report's and the KL evaluation's reference).
"""

from __future__ import annotations

import torch
from torch import nn

from ...dist.fsdp import is_sharded
from ...numerics.gptq import nvfp4_gptq
from ...numerics.nvfp4 import nvfp4_block_scales
from .base import ForwardLoop, register_calibrator
from .local_hessian import input_moments, nvfp4_linears
from .max import MaxCalibrator
from .weights import SKIPPED_MXFP4, weight_sites


@register_calibrator
class GptqCalibrator(MaxCalibrator):
    method = "gptq"

    def __init__(self, algorithm) -> None:
        super().__init__(algorithm)
        if algorithm.get("block_size") <= 0 or algorithm.get("block_size") % 16:
            raise ValueError(f"algorithm gptq: block_size must be a positive multiple of 16, got {algorithm.get('block_size')}")

    def calibrate(self, model: nn.Module, forward_loop: ForwardLoop | None,
                  groups: dict[str, tuple[str, ...]]) -> None:
        if forward_loop is None:
            raise ValueError("algorithm gptq needs calibration data (a forward_loop)")
        dense = nvfp4_linears(model)
        sharded = [n for n, m in model.named_modules() if id(m) in dense and is_sharded(m.weight)]
        if sharded:  # the same on every rank: refused before any collective
            raise ValueError(f"algorithm gptq updates whole weights, but {sharded[0]} is FSDP2-sharded: "
                             "use --plan whole or expert_parallel with --dense replicated")
        super().calibrate(model, forward_loop, groups)  # max: input scales, global scales, groups
        moments = input_moments(model, forward_loop, blocks=False, raw_input=False)
        linears = nvfp4_linears(model)
        names = {id(m): n for n, m in model.named_modules()}
        for key, m in linears.items():
            sums, tokens = moments[key]
            q = m.weight_quantizer
            if tokens == 0:
                self.labels[names[key]] = "max (no calibration tokens reached it)"
                continue
            w = m.weight.detach()
            gs = q.scale().to(w.device)
            q.block_scale = nvfp4_block_scales(w, gs)  # max's, fixed: GPTQ moves values, not scales
            h = (2.0 * sums / tokens).to(torch.float32).to(w.device)
            q.updated_weight = nvfp4_gptq(w, h, gs, q.block_scale, self.algorithm.get("perc_damp"),
                                          self.algorithm.get("block_size")).to(w.dtype)
            self.labels[names[key]] = str(self.algorithm)
            self.weight_algorithms[names[key]] = "gptq"  # max's scales, GPTQ's values: the update is the weight's
        for site in weight_sites(model):
            if site.experts:
                self.labels[site.name] = SKIPPED_MXFP4 if site.quantizer.source is not None else \
                    "max (gptq of routed experts not built)"
