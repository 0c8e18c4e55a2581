"""``mse``: max, then every NVFP4 weight's block scales by least weight error (ModelOpt 0.47
``mse_calibrate`` / ``_mse_calibrate_weights``; numerics in numerics/nvfp4_search.py).

- ``fp8_scale_sweep: true``: each block tries all 126 positive E4M3 scales (``nvfp4_mse``);
- otherwise a multiplier search over ``linspace(start_multiplier, stop_multiplier)`` times the block
  amax; with ``four_over_six: true`` (multipliers 1.0 and 1.5, ModelOpt's 4/6 preset) the global
  scale is ``amax / (6 * 256)`` so a block may map its max to 6 or to 4.

Activation scales are max's (ModelOpt: "dynamic activation quantizers are not MSE-calibrated").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...numerics.nvfp4_search import (
    linspace_multipliers,
    nvfp4_global_scale_46,
    nvfp4_multiplier_block_scales,
    nvfp4_sweep_block_scales,
)
from ...recipe.algorithm import AlgorithmError
from .base import AlgorithmConfig, register_calibrator
from .max import MaxCalibrator
from .weights import WeightSite, search_sites


@dataclass(frozen=True)
class MseConfig(AlgorithmConfig):
    """``algorithm: {method: mse, ...}``, ModelOpt 0.47's ``MseCalibConfig`` defaults, plus ``four_over_six``."""

    method = "mse"
    weight_algorithms = ("mse", "four_over_six")
    presets = {
        "mse": {"fp8_scale_sweep": True},  # NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG
        "four_over_six": {"fp8_scale_sweep": False, "start_multiplier": 1.0, "stop_multiplier": 1.5,
                          "step_size": 0.5, "four_over_six": True},  # NVFP4_FOUR_OVER_SIX_CFG
    }

    fp8_scale_sweep: bool = False
    step_size: float = 0.1
    start_multiplier: float = 0.25
    stop_multiplier: float = 4.0
    four_over_six: bool = False

    def check(self) -> None:
        if self.four_over_six and self.fp8_scale_sweep:
            raise AlgorithmError("algorithm mse: four_over_six chooses between two multipliers; it cannot "
                                 "combine with fp8_scale_sweep (ModelOpt's 4/6 preset sets fp8_scale_sweep: false)")

    def state_bytes(self, out_features: int, in_features: int, dtype_bytes: int) -> tuple[int, int]:
        """The searched E4M3 block scales, one byte per 16 weights, kept until the export."""
        return 0, out_features * in_features // 16


@register_calibrator
class MseCalibrator(MaxCalibrator):
    config_type = MseConfig

    def __init__(self, algorithm, config) -> None:
        super().__init__(algorithm, config)
        # four_over_six is an mse option only (local_hessian keeps the 448 normalization).
        self.four_over_six = getattr(config, "four_over_six", False)
        self.multipliers = linspace_multipliers(config.start_multiplier, config.stop_multiplier, config.step_size)

    def hessian(self, module: nn.Module, param: str, expert: int | None = None) -> torch.Tensor | None:
        """The error weighting of one weight's blocks (``expert``: that local expert's); None: plain squared error."""
        return None

    def search(self, w: torch.Tensor, gs: torch.Tensor, module: nn.Module, param: str,
               experts: range | None = None) -> torch.Tensor:
        if experts is None:
            return self._search(w, gs, self.hessian(module, param))
        hs = [self.hessian(module, param, e) for e in experts]
        if all(h is None for h in hs):
            return self._search(w, gs, None)
        # Each expert under its own weighting (the rows are independent: batching changes no block's choice).
        return torch.stack([self._search(w[j], gs[j], h) for j, h in enumerate(hs)])

    def _search(self, w: torch.Tensor, gs: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
        if self.config.fp8_scale_sweep:
            return nvfp4_sweep_block_scales(w, gs, hessian=h)
        return nvfp4_multiplier_block_scales(w, gs, self.multipliers, hessian=h)

    def choice(self, site: WeightSite) -> tuple[str, str]:
        """What a searched site's scales are called: (its config's ``weight_algorithms`` entry, label)."""
        return ("four_over_six" if self.four_over_six else "mse"), str(self.algorithm)

    def finalize(self, model: nn.Module, groups: dict[str, tuple[str, ...]]) -> None:
        super().finalize(model, groups)  # global scales final (groups shared) before any block search
        self.finalize_weights(model)

    def finalize_weights(self, model: nn.Module) -> None:
        global_scale = (lambda q: nvfp4_global_scale_46(q.amax)) if self.four_over_six else None
        search_sites(model, self.config.method, self.search, self.labels, self.choice, self.weight_algorithms, global_scale)
