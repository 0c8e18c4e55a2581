"""Pure numbers of the quantization report: weight error, block-scale flags, activation counts.

Every function takes tensors and returns tensors (or plain numbers); nothing here knows a model, a
rank or a file. Leading dims are a batch (``[n, out, in]``: one row of results per expert; a dense
weight is ``[1, out, in]``). Sums are float64 so that per-expert and per-rank partial sums add up to
the same totals whatever the split.

Block flags follow the NVFP4 rules of ``numerics/nvfp4.py`` (docs/FORMATS.md): a block of 16 has the
unclamped scale ``block_amax / fp32(6 * global_scale)``; it *saturates* above 448 (clamped: the block's
values clip) and *underflows* below 2**-9 (clamped up: a coarser step than the block asks for; all-zero
blocks are never counted). Formats without two-level block scales (FP8) count elements instead: an
element saturates above ``448 * scale``; underflow is not counted for them (None).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .constants import FP4_MAX, FP8_E4M3_MAX, FP8_E4M3_MIN_SUBNORMAL

# Fields of one weight row (per expert or per dense module), in this order (``weight_rows``).
WEIGHT_FIELDS = ("numel", "sse", "ssq", "max_abs_err", "amax", "units", "saturated", "underflow")


def block_flags(x: Tensor, global_scale: Tensor, block: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per leading index ``[n]``: (blocks, blocks whose scale saturates, non-zero blocks whose scale
    underflows), for ``x [n, ..., k * block]`` and one global scale per leading index (or a scalar)."""
    n = x.shape[0]
    blocks = x.reshape(n, -1, block).abs().amax(dim=-1).float()  # [n, B]
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device).reshape(-1)
    gs = gs.expand(n) if gs.numel() == 1 else gs
    denom = gs * torch.tensor(FP4_MAX, device=x.device)  # rounded once, as numerics/nvfp4.py
    raw = blocks / denom.view(n, 1)
    saturated = (raw > FP8_E4M3_MAX).sum(dim=1)
    underflow = ((blocks > 0) & (raw < FP8_E4M3_MIN_SUBNORMAL)).sum(dim=1)
    return torch.full((n,), blocks.shape[1], dtype=torch.int64, device=x.device), saturated, underflow


def weight_rows(source: Tensor, dequant: Tensor, *, block: int | None, scale: Tensor | None) -> Tensor:
    """float64 ``[n, len(WEIGHT_FIELDS)]`` for a source weight and its dequantized export, both
    ``[n, out, in]``. ``block``: the NVFP4 block (two-level scales; ``scale`` is the global scale per
    row) or None (element units; ``scale`` the per-tensor FP8 scale, or None for block-scaled FP8)."""
    src, dq = source.float(), dequant.float()
    n = src.shape[0]
    err = (dq - src).reshape(n, -1).double()
    flat = src.reshape(n, -1)
    if block is not None:
        units, saturated, underflow = block_flags(src, scale, block)
        underflow = underflow.double()
    else:
        units = torch.full((n,), flat.shape[1], dtype=torch.int64, device=src.device)
        if scale is None:
            saturated = torch.zeros(n, dtype=torch.int64, device=src.device)
        else:
            limit = torch.as_tensor(scale, dtype=torch.float32, device=src.device).reshape(-1, 1) * FP8_E4M3_MAX
            saturated = (flat.abs() > limit).sum(dim=1)
        underflow = torch.full((n,), math.nan, dtype=torch.float64, device=src.device)
    return torch.stack([
        torch.full((n,), flat.shape[1], dtype=torch.float64, device=src.device),
        err.pow(2).sum(dim=1),
        flat.double().pow(2).sum(dim=1),
        err.abs().amax(dim=1),
        flat.abs().amax(dim=1).double(),
        units.double(),
        saturated.double(),
        underflow,
    ], dim=1)


def rel_rms(sse: float, ssq: float) -> float:
    """``sqrt(sum err^2 / sum x^2)``; 0 for an exact zero tensor, inf for error on a zero reference."""
    if ssq > 0:
        return math.sqrt(sse / ssq)
    return 0.0 if sse == 0 else math.inf


def input_counts(x: Tensor, amax: Tensor, global_scale: Tensor, block: int | None) -> Tensor:
    """int64 ``[4]`` for one activation tensor under its final scale: (values, values clipped (|x| >
    amax), blocks, blocks whose scale underflows); the last two are 0 without two-level block scales."""
    clipped = (x.abs().float() > amax.float().to(x.device)).sum()
    if block is None:
        zero = torch.zeros((), dtype=torch.int64, device=x.device)
        return torch.stack([torch.tensor(x.numel(), device=x.device), clipped, zero, zero])
    nb, _, underflow = block_flags(x.reshape(1, -1), global_scale.reshape(()), block)
    return torch.stack([torch.tensor(x.numel(), device=x.device), clipped, nb[0], underflow[0]])


def hidden_error_sums(reference: Tensor, quantized: Tensor) -> Tensor:
    """float64 ``[2]``: (sum of squared difference, sum of squared reference) of two hidden states."""
    ref = reference.double()
    return torch.stack([(quantized.double() - ref).pow(2).sum(), ref.pow(2).sum()])


def kl_and_top1(ref_logits: Tensor, quant_logits: Tensor) -> Tensor:
    """float64 ``[3]``: (sum over tokens of KL(p_ref || p_quant) in nats, tokens whose argmax agrees, tokens)."""
    ref = torch.log_softmax(ref_logits.float(), dim=-1)
    quant = torch.log_softmax(quant_logits.float(), dim=-1)
    kl = (ref.exp() * (ref - quant)).sum(-1)
    agree = (ref_logits.argmax(-1) == quant_logits.argmax(-1)).sum()
    return torch.stack([kl.sum().double(), agree.double(), torch.tensor(kl.numel(), dtype=torch.float64,
                                                                           device=kl.device)])
