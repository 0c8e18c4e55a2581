"""Calibrators, registered by ``recipe.algorithm``'s method (nvidia-modelopt 0.47 spellings).

A calibrator is one object with three steps over a quantized model: ``observe`` (statistics from the
calibration forward), ``reduce`` (across ranks) and ``finalize`` (the scales, and for weight
algorithms each weight's block scales). ``calibrator_for(recipe.algorithm)`` picks it; ``quantize``
runs ``calibrate``. Registered: ``max`` (max.py), ``mse`` (mse.py: FP8 scale sweep, multiplier
search, four-over-six), ``local_hessian`` (local_hessian.py), ``gptq`` (gptq.py: dense Linears and routed experts, each expert by
its owner; ModelOpt's one Hessian forward, or with ``true_sequential``/``asymmetric`` in stages within a layer;
under ``modelopt_k3.layerwise`` each layer's inputs from the quantized layers before it).
"""

from __future__ import annotations

from .base import CALIBRATORS, Calibrator, calibrator_for, register_calibrator
from .gptq import GptqCalibrator
from .local_hessian import LocalHessianCalibrator
from .max import MaxCalibrator
from .mse import MseCalibrator

__all__ = [
    "CALIBRATORS",
    "Calibrator",
    "GptqCalibrator",
    "LocalHessianCalibrator",
    "MaxCalibrator",
    "MseCalibrator",
    "calibrator_for",
    "register_calibrator",
]
