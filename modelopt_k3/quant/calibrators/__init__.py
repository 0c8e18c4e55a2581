"""Calibrators: one typed config and one handler per algorithm (nvidia-modelopt 0.47 spellings), registered once
by config type (``base``: the contract and the registry every consumer asks).

A handler has three steps over a quantized model: ``observe`` (statistics from the calibration forward),
``reduce`` (across ranks) and ``finalize`` (the scales, and for weight algorithms each weight's block scales).
``calibrator_for(recipe.algorithm)`` picks it; ``quantize`` runs ``calibrate``. Registered: ``max`` (max.py),
``mse`` (mse.py: FP8 scale sweep, multiplier search, four-over-six), ``local_hessian`` (local_hessian.py),
``gptq`` (gptq.py: dense Linears and routed experts, each expert by its owner; ModelOpt's one Hessian forward,
or with ``true_sequential``/``asymmetric`` in stages within a layer; under ``modelopt_k3.layerwise`` each
layer's inputs from the quantized layers before it), ``nvfp4_act_headroom`` (act_headroom.py: NVFP4 input
global scales with headroom above the calibrated range), ``awq`` (awq.py: activation-aware smoothing folded
into the norms, then max or gptq).

Each algorithm's module is imported here by name (nothing in the package is found by its file name:
tests/spec/test_whole_contract.py), in the order the registry lists them: adding one is its file, its line below
and its tests (docs/decisions/0002-calibrator-registry.md).
"""

from __future__ import annotations

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

# The algorithms, registered on import in this order (the registry's order: its messages and lists).
# isort: off
from . import max, mse, local_hessian, gptq, act_headroom, awq  # noqa: F401
# isort: on

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
