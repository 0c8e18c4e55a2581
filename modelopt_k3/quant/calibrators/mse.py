"""``mse``: max, then every NVFP4 weight's block scales by least weight error (ModelOpt 0.47
``mse_calibrate`` / ``_mse_calibrate_weights``; numerics in numerics/nvfp4_search.py).

- ``fp8_scale_sweep: true``: each block tries all 126 positive E4M3 scales (``nvfp4_mse``);
- otherwise a multiplier search over ``linspace(start_multiplier, stop_multiplier)`` times the block
  amax; with ``four_over_six: true`` (multipliers 1.0 and 1.5, ModelOpt's 4/6 preset) the global
  scale is ``amax / (6 * 256)`` so a block may map its max to 6 or to 4.

Activation scales are max's (ModelOpt: "dynamic activation quantizers are not MSE-calibrated").
"""

from __future__ import annotations

import torch
from torch import nn

from ...numerics.nvfp4_search import (
    linspace_multipliers,
    nvfp4_global_scale_46,
    nvfp4_multiplier_block_scales,
    nvfp4_sweep_block_scales,
)
from .base import register_calibrator
from .max import MaxCalibrator
from .weights import WeightSite, search_sites


@register_calibrator
class MseCalibrator(MaxCalibrator):
    method = "mse"

    def __init__(self, algorithm) -> None:
        super().__init__(algorithm)
        # four_over_six is an mse option only (local_hessian keeps the 448 normalization).
        self.four_over_six = algorithm.method == "mse" and algorithm.get("four_over_six")
        if self.four_over_six and algorithm.get("fp8_scale_sweep"):
            raise ValueError("algorithm mse: four_over_six chooses between two multipliers; it cannot "
                             "combine with fp8_scale_sweep (ModelOpt's 4/6 preset sets fp8_scale_sweep: false)")
        self.multipliers = linspace_multipliers(
            algorithm.get("start_multiplier"), algorithm.get("stop_multiplier"), algorithm.get("step_size"))

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
        if self.algorithm.get("fp8_scale_sweep"):
            return nvfp4_sweep_block_scales(w, gs, hessian=h)
        return nvfp4_multiplier_block_scales(w, gs, self.multipliers, hessian=h)

    def choice(self, site: WeightSite) -> tuple[str, str]:
        """What a searched site's scales are called: (``WEIGHT_ALGORITHMS`` entry, label)."""
        return ("four_over_six" if self.four_over_six else "mse"), str(self.algorithm)

    def finalize(self, model: nn.Module, groups: dict[str, tuple[str, ...]]) -> None:
        super().finalize(model, groups)  # global scales final (groups shared) before any block search
        self.finalize_weights(model)

    def finalize_weights(self, model: nn.Module) -> None:
        global_scale = (lambda q: nvfp4_global_scale_46(q.amax)) if self.four_over_six else None
        search_sites(model, self.method, self.search, self.labels, self.choice, self.weight_algorithms, global_scale)
