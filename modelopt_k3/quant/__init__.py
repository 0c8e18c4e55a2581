"""Quantizers, recipe matching, the decision table and ``max`` calibration."""

from .api import QuantPlan, plan_quantization, quantize
from .decisions import Decision, DecisionTable, decide
from .quantizer import TensorQuantizer
from .shared_inputs import SharedInputRule, discover_shared_inputs

__all__ = [
    "Decision",
    "DecisionTable",
    "QuantPlan",
    "SharedInputRule",
    "TensorQuantizer",
    "decide",
    "discover_shared_inputs",
    "plan_quantization",
    "quantize",
]
