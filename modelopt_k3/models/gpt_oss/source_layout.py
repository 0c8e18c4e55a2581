"""GPT-OSS tensor layouts: the OpenAI MXFP4 checkpoint, transformers' ``GptOssExperts``, ModelOpt's export.

Pure functions (no modules, no I/O); the numerics are ``numerics/mxfp4.py`` and ``numerics/convert.py``,
only the layout mapping lives here (facts in docs/decisions/0026-gpt-oss.md).

- Checkpoint, per MoE layer and fused projection ``p`` (``gate_up_proj``: out = 2I, in = H; ``down_proj``:
  out = H, in = I): ``p_blocks`` uint8 ``[E, out, in/32, 16]`` and ``p_scales`` uint8 ``[E, out, in/32]``.
  The 16 bytes of a block are its 32 E2M1 codes, element 2i in the low nibble; the scale is E8M0 with
  bias 127. Flattening the last two dims gives exactly the project's MXFP4 fields
  (``weight_packed [E, out, in/2]``, ``weight_scale [E, out, in/32]``).
- gate_up rows are interleaved: row 2j is gate channel j, row 2j+1 up channel j (also in ``p_bias``).
- transformers' ``GptOssExperts`` holds ``gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]``: the
  decoded checkpoint transposed (``x @ W``), columns still interleaved.
- ModelOpt's NVFP4 export of ``GptOssExperts`` (its BMM-experts path): one fused tensor per projection,
  quantized over ``in`` and stored transposed back, ``p`` uint8 ``[E, in/2, out]``, ``p_weight_scale``
  float8_e4m3fn ``[E, in/16, out]``, ``p_weight_scale_2`` float32 ``[]`` (one per layer and projection:
  the quantizer is the fused parameter's), ``p_input_scale`` float32 ``[]``, ``p_bias`` unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...numerics.constants import MXFP4_BLOCK
from ...numerics.convert import mxfp4_to_nvfp4, shared_global_scale_for
from ...numerics.nvfp4 import NVFP4Weight, nvfp4_dequantize

BLOCK_BYTES = MXFP4_BLOCK // 2  # 16 bytes hold one 32-element block


def mxfp4_fields(blocks: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """OpenAI ``(p_blocks [..., out, in/32, 16], p_scales [..., out, in/32])`` as the project's MXFP4
    ``(weight_packed [..., out, in/2], weight_scale [..., out, in/32])``: a view, no byte moves."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != BLOCK_BYTES or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"OpenAI MXFP4 layout needs blocks [..., out, in/32, {BLOCK_BYTES}] and scales [..., out, in/32]; "
            f"got {list(blocks.shape)} and {list(scales.shape)}"
        )
    return blocks.reshape(*blocks.shape[:-2], -1), scales


def deinterleave(t: Tensor, dim: int) -> Tensor:
    """Interleaved gate/up along ``dim`` (gate at even, up at odd positions) -> ``[gate..., up...]``."""
    dim = dim % t.dim()
    if t.shape[dim] % 2:
        raise ValueError(f"gate/up dim {dim} of {list(t.shape)} is odd")
    index = [slice(None)] * t.dim()
    index[dim] = slice(0, None, 2)
    gate = t[tuple(index)]
    index[dim] = slice(1, None, 2)
    return torch.cat((gate, t[tuple(index)]), dim=dim)


def interleave(t: Tensor, dim: int) -> Tensor:
    """Inverse of ``deinterleave``: ``[gate..., up...]`` along ``dim`` -> gate at even, up at odd positions."""
    dim = dim % t.dim()
    gate, up = t.chunk(2, dim=dim)
    return torch.stack((gate, up), dim=dim + 1).flatten(dim, dim + 1)


def layer_global_scale(scales: Tensor) -> Tensor:
    """0-d power-of-two ``weight_scale_2`` of one fused projection (all its experts and rows): its largest
    E8M0 block scale maps to 2**8 (``numerics/convert.py``). ModelOpt's cast pins the same value
    (``2**(k_max - 8)``), one per fused tensor."""
    return shared_global_scale_for(scales.reshape(-1, scales.shape[-1]))


def nvfp4_experts(blocks: Tensor, scales: Tensor, global_scale: Tensor | None = None) -> tuple[dict[str, Tensor], int]:
    """Calibration-free NVFP4 of one fused projection in ModelOpt's export layout.

    Returns ``({"weight": uint8 [E, in/2, out], "weight_scale": e4m3 [E, in/16, out], "weight_scale_2": f32 []},
    n_requantized_blocks)``. ``global_scale`` defaults to ``layer_global_scale(scales)``; under expert
    parallelism pass the max over every rank's (it depends on all experts).
    """
    packed, scale = mxfp4_fields(blocks, scales)
    gs = layer_global_scale(scales) if global_scale is None else global_scale
    w, n_req = mxfp4_to_nvfp4(packed, scale, gs)
    return bmm_layout(w), n_req


def bmm_layout(w: NVFP4Weight) -> dict[str, Tensor]:
    """An NVFP4 ``[E, out, in]`` weight as ModelOpt writes a BMM-style experts parameter (transposed)."""
    return {
        "weight": w.packed.transpose(-1, -2).contiguous(),
        "weight_scale": w.block_scale.transpose(-1, -2).contiguous(),
        "weight_scale_2": w.global_scale.reshape(()).float(),
    }


def dequantize_bmm(weight: Tensor, weight_scale: Tensor, weight_scale_2: Tensor,
                   dtype: torch.dtype = torch.float32) -> Tensor:
    """What a reader of ModelOpt's layout computes: ``[E, in, out]``, the ``GptOssExperts`` parameter layout."""
    w = nvfp4_dequantize(weight.transpose(-1, -2).contiguous(), weight_scale.transpose(-1, -2).contiguous(),
                         weight_scale_2, dtype)
    return w.transpose(-1, -2)
