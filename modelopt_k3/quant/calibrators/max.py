"""``max``: input amax is the running max over the calibration forward, max-reduced over ranks; weight
amax (the per-tensor scale) was taken from the weights when the quantizers were attached
(quant/modules.py); shared-input groups then take their members' max (quant/calibrate.py holds the
steps, this object sequences them). Block scales stay the format's own (block amax / (6 * global))."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..calibrate import check_calibrated, observe_inputs, share_group_amax, sync_amax
from ..modules import set_mode
from .base import AlgorithmConfig, Calibrator, ForwardLoop, register_calibrator
from .weights import max_algorithms


@dataclass(frozen=True)
class MaxConfig(AlgorithmConfig):
    """``algorithm: max``: no options; weights keep the format's own block scales (recorded as ``max``)."""

    method = "max"
    weight_algorithms = ("max",)


@register_calibrator
class MaxCalibrator(Calibrator):
    config_type = MaxConfig

    def observe(self, model: nn.Module, forward_loop: ForwardLoop | None) -> None:
        observe_inputs(model, forward_loop)

    def reduce(self, model: nn.Module) -> None:
        sync_amax(model)

    def finalize(self, model: nn.Module, groups: dict[str, tuple[str, ...]]) -> None:
        check_calibrated(model)
        set_mode(model, "quant")
        share_group_amax(model, groups)
        max_algorithms(model, self.weight_algorithms)
