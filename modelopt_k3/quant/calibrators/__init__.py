"""Calibrators: one typed config and one handler per algorithm (nvidia-modelopt 0.47 spellings), registered once
by config type (``base``: the contract and the registry every consumer asks).

A handler has three steps over a quantized model: ``observe`` (statistics from the calibration forward),
``reduce`` (across ranks) and ``finalize`` (the scales, and for weight algorithms each weight's block scales).
``calibrator_for(recipe.algorithm)`` picks it; ``quantize`` runs ``calibrate``. Registered: ``max`` (max.py),
``mse`` (mse.py: FP8 scale sweep, multiplier search, four-over-six), ``local_hessian`` (local_hessian.py),
``gptq`` (gptq.py: dense Linears and routed experts, each expert by its owner; ModelOpt's one Hessian forward,
or with ``true_sequential``/``asymmetric`` in stages within a layer; under ``modelopt_k3.layerwise`` each
layer's inputs from the quantized layers before it), ``nvfp4_act_headroom`` (act_headroom.py: NVFP4 input
global scales with headroom above the calibrated range).

Every module of this package is imported here, so an algorithm registers by being a file in it: adding one is
that file and its tests (docs/decisions/0002-calibrator-registry.md).
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import (
    CALIBRATORS,
    CONFIGS,
    LOSSLESS_CAST,
    AlgorithmConfig,
    Calibrator,
    algorithm_config,
    calibrator_for,
    qdq_inputs,
    qformat_presets,
    register_calibrator,
    weight_algorithm_names,
)

# Sorted, so the registration order (and every list the registry gives) is the same in every process.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

__all__ = [
    "CALIBRATORS",
    "CONFIGS",
    "LOSSLESS_CAST",
    "AlgorithmConfig",
    "Calibrator",
    "algorithm_config",
    "calibrator_for",
    "qdq_inputs",
    "qformat_presets",
    "register_calibrator",
    "weight_algorithm_names",
]
