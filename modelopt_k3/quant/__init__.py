"""Quantizers, recipe matching and ``max`` calibration."""

from .api import QuantPlan, plan_quantization, quantize
from .quantizer import TensorQuantizer

__all__ = ["QuantPlan", "TensorQuantizer", "plan_quantization", "quantize"]
