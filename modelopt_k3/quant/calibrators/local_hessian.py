"""``local_hessian``: max, then a forward with activations fake-quantized and weights not, recording each
NVFP4 weight's per-block input second moment ``H_b = E[x_b x_bᵀ]`` (16x16 per block of in features), then
the block-scale search of ``mse`` weighted by it: error ``dwᵀ H_b dw``, which approximates the block's share
of ``||WX - ŴX||²`` (ModelOpt 0.47 ``local_hessian_calibrate``).

- Dense Linears: the input as it arrives, before the Linear's own input quantizer (ModelOpt's hook). They are
  replicated and each rank saw its own tokens, so the sums and token counts are all-reduced; the sums are
  integer-valued float64 (``moments.Accumulator``), exact in any order, so N ranks pick the scales 1 process
  picks, bit for bit. ModelOpt leaves this unsynced.
- Routed experts (ours; ModelOpt has no per-expert input hook on fused experts and falls back to plain MSE):
  each local expert's Hessian from the tokens routed to it, taken by its owner in the same forward
  (``moments.ExpertSums``), nothing per expert travels. The inputs are those the expert GEMMs multiply: the
  gate/up input after the experts' input quantizer (which runs at the origin, before ``torch_a2a``'s exchange,
  so the owner never holds the raw one), the down input recomputed from it; replicated expert groups add up
  their replicas' sums. An expert no token reached, and packed-resident experts, get the plain-error search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...numerics.constants import NVFP4_BLOCK
from ...recipe.algorithm import AlgorithmError
from ..schemes import NVFP4_TENSOR
from .base import AlgorithmConfig, ForwardLoop, register_calibrator
from .moments import ExpertSums, input_moments, nvfp4_linears, owner_observes
from .mse import MseCalibrator
from .weights import WeightSite, weight_sites

__all__ = ["LocalHessianCalibrator", "input_moments"]


def _expert_sites(model: nn.Module) -> tuple[dict[int, tuple[nn.Module, dict[str, ExpertSums]]], dict[str, str]]:
    """The routed experts whose owners take block Hessians (by module ``id``), and why the others do not."""
    observed: dict[int, tuple[nn.Module, dict[str, ExpertSums]]] = {}
    not_built: dict[str, str] = {}
    for site in weight_sites(model):
        q, m = site.quantizer, site.module
        if not site.experts or q.fmt is not NVFP4_TENSOR or q.source is not None:
            continue  # dense; or max's / the lossless cast's scales, kept by search_sites
        if not owner_observes(m, site.param):
            not_built[site.name] = "packed or unknown layout"
        else:
            observed.setdefault(id(m), (m, {}))[1][site.param] = ExpertSums(m.quant, site.param, True)
    return observed, not_built


@dataclass(frozen=True)
class LocalHessianConfig(AlgorithmConfig):
    """``algorithm: {method: local_hessian, ...}``, ModelOpt 0.47's ``LocalHessianCalibConfig`` defaults."""

    method = "local_hessian"
    weight_algorithms = ("local_hessian",)
    presets = {"local_hessian": {"fp8_scale_sweep": True}}

    fp8_scale_sweep: bool = True
    step_size: float = 0.1
    start_multiplier: float = 0.25
    stop_multiplier: float = 4.0
    block_size: int = 16

    def check(self) -> None:
        if self.block_size != NVFP4_BLOCK:
            raise AlgorithmError(f"algorithm local_hessian: block_size must be the NVFP4 block {NVFP4_BLOCK}, "
                                 f"got {self.block_size}")

    def state_bytes(self, out_features: int, in_features: int, dtype_bytes: int) -> tuple[int, int]:
        """Float64 hi/lo block sums ``2 x [in/16, 16, 16]`` and the fp32 Hessian (``in * 320`` bytes), and the
        searched E4M3 block scales, one byte per 16 weights, kept until the export."""
        return 320 * in_features, out_features * in_features // 16


@register_calibrator
class LocalHessianCalibrator(MseCalibrator):
    config_type = LocalHessianConfig

    def __init__(self, algorithm, config) -> None:
        super().__init__(algorithm, config)
        self.hessians: dict[int, torch.Tensor] = {}  # dense Linear id -> [in/16, 16, 16]
        # (experts module id, param) -> local expert -> [in/16, 16, 16]; experts without tokens are absent
        self.expert_hessians: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        self.not_built: dict[str, str] = {}  # expert site -> why it has no Hessians

    def hessian(self, module: nn.Module, param: str, expert: int | None = None) -> torch.Tensor | None:
        if expert is None:
            return self.hessians.get(id(module))
        return self.expert_hessians.get((id(module), param), {}).get(expert)

    def choice(self, site: WeightSite) -> tuple[str, str]:
        """Without a Hessian (a Linear no token reached; experts not observed) the search is mse's plain one."""
        if site.experts:
            if site.name in self.not_built:
                return "mse", f"{self.algorithm} (no input Hessian here, {self.not_built[site.name]}: plain-error search)"
            n, got = site.quantizer.amax.shape[0], len(self.expert_hessians.get((id(site.module), site.param), {}))
            if got == 0:
                return "mse", f"{self.algorithm} (no calibration tokens reached its experts: plain-error search)"
            idle = f" ({n - got} of {n} local experts got no tokens: plain-error search there)" if got < n else ""
            return "local_hessian", f"{self.algorithm}{idle}"
        if self.hessian(site.module, site.param) is None:
            return "mse", f"{self.algorithm} (no input Hessian here: plain-error search)"
        return "local_hessian", str(self.algorithm)

    def calibrate(self, model: nn.Module, forward_loop: ForwardLoop | None,
                  groups: dict[str, tuple[str, ...]]) -> None:
        if forward_loop is None:
            raise ValueError("algorithm local_hessian needs calibration data (a forward_loop)")
        self.observe(model, forward_loop)
        self.reduce(model)
        super(MseCalibrator, self).finalize(model, groups)  # max's finalize: input scales, groups
        linears = nvfp4_linears(model)
        experts, self.not_built = _expert_sites(model)
        # The layer's input as it arrives, upstream activations fake-quantized (ModelOpt's hook sees it
        # before the layer's own input quantizer, which runs inside its forward).
        moments = input_moments(model, forward_loop, blocks=True, raw_input=True, experts=experts)
        self.hessians = {k: (sums / tokens).to(torch.float32).to(linears[k].weight.device)
                         for k, (sums, tokens) in moments.items() if tokens > 0}
        self.expert_hessians = {}
        for key, (module, by_param) in experts.items():
            for param, sums in by_param.items():
                sums.reduce_over_replicas(module)  # replicated expert groups: every replica's tokens
                device = getattr(module, param).device
                found = {}
                for e in sorted(sums.by_expert):
                    got = sums.pop(e)
                    if got is not None:
                        found[e] = (got[0] / got[1]).to(torch.float32).to(device)
                self.expert_hessians[(key, param)] = found
        super().finalize_weights(model)
        self.expert_hessians = {}
