"""Pure tensor numerics for E2M1/MXFP4/NVFP4/FP8 (no modules, no I/O; rules in docs/FORMATS.md)."""

from .block_fp8 import block_fp8_decode, block_fp8_scale_shape
from .constants import FP4_MAX, FP8_E4M3_MAX
from .convert import mxfp4_to_nvfp4, shared_global_scale_for
from .e2m1 import E2M1_VALUES, e2m1_decode, e2m1_round, pack_fp4, unpack_fp4
from .fp8 import (
    fp8_dequantize_blockwise,
    fp8_dequantize_per_tensor,
    fp8_fake_quant_blockwise,
    fp8_fake_quant_per_tensor,
    fp8_quantize_blockwise,
    fp8_quantize_per_tensor,
    fp8_scale,
)
from .int4_packed import int4_pack, int4_packed_decode, int4_unpack
from .mxfp4 import e8m0_to_float, mxfp4_decode, mxfp4_encode
from .nvfp4 import (
    NVFP4Weight,
    nvfp4_block_scales,
    nvfp4_dequantize,
    nvfp4_fake_quant,
    nvfp4_global_scale,
    nvfp4_quantize,
)

__all__ = [
    "E2M1_VALUES",
    "FP4_MAX",
    "FP8_E4M3_MAX",
    "NVFP4Weight",
    "block_fp8_decode",
    "block_fp8_scale_shape",
    "e2m1_decode",
    "e2m1_round",
    "e8m0_to_float",
    "fp8_dequantize_blockwise",
    "fp8_dequantize_per_tensor",
    "fp8_fake_quant_blockwise",
    "fp8_fake_quant_per_tensor",
    "fp8_quantize_blockwise",
    "fp8_quantize_per_tensor",
    "fp8_scale",
    "int4_pack",
    "int4_packed_decode",
    "int4_unpack",
    "mxfp4_decode",
    "mxfp4_encode",
    "mxfp4_to_nvfp4",
    "nvfp4_block_scales",
    "nvfp4_dequantize",
    "nvfp4_fake_quant",
    "nvfp4_global_scale",
    "nvfp4_quantize",
    "pack_fp4",
    "shared_global_scale_for",
    "unpack_fp4",
]
