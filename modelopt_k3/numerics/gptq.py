"""GPTQ for NVFP4 weights with fixed scales (pure tensor functions).

Semantics of nvidia-modelopt 0.47 (``utils/calib_utils.py`` ``compute_hessian_inverse``,
``gptq_blockwise_update``; ``model_calib.py`` ``gptq``): the scales are max's (block scales from the
original weight's block amax, the global scale as calibrated) and stay fixed; columns are quantized
left to right, each column's rounding error spread over the columns not yet quantized through the
upper Cholesky factor of the damped inverse Hessian, in column blocks of ``block_size``.

``H`` is ``2/n * sum x xᵀ`` over the layer's calibration inputs ``[in, in]``. Damping adds
``perc_damp * mean(diag H)`` to the diagonal; columns whose weights are all zero get an identity
row/column first (dead inputs); a Hessian that is still not positive definite falls back to the
identity (plain rounding), as ModelOpt does. Everything runs in fp32 (ModelOpt's dtype); the
result is the dequantized weight, whose export with the same scales gives its codes exactly.

``asymmetric_target`` (ours, not ModelOpt's): when a Linear's inputs ``X̃`` differ from the unquantized
model's ``X`` (earlier Linears quantized), ``||W X - Ŵ X̃||²`` equals ``(ŵ - w')ᵀ H̃ (ŵ - w')`` plus a constant
for each row, with ``w' = w + H̃⁻¹ X̃ᵀ (X - X̃) w``: GPTQ on the target ``W'`` with ``X̃``'s Hessian aims at the
unquantized output (the asymmetric objective of GPTAQ, Li et al. 2025), compensating the inputs' error too.

``nvfp4_gptq_batched`` (ours; llm-compressor 0.14 batches its MoE experts alike): ``E`` same-shape experts in one
pass, every step a batched tensor op, so the per-column loop runs once for all of them instead of once per expert.
Each expert's result equals ``nvfp4_gptq``'s on it bit for bit (tests/numerics/test_gptq_batched.py): the batched
steps are elementwise, or per-matrix LAPACK/BLAS calls that PyTorch's CPU backend makes matrix by matrix, and the
one reduction (``mean(diag H)``) runs on a contiguous copy of each diagonal as ``torch.diag`` gives it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .constants import NVFP4_BLOCK
from .e2m1 import _e2m1_keys, _table

__all__ = [
    "asymmetric_target",
    "gptq_batch_bytes",
    "gptq_hessian_inverse",
    "gptq_hessian_inverse_batched",
    "nvfp4_gptq",
    "nvfp4_gptq_batched",
]


def gptq_hessian_inverse(hessian: Tensor, weight: Tensor, perc_damp: float) -> Tensor:
    """Upper Cholesky factor of ``(H + damp I)^-1`` (``[in, in]`` fp32); identity if H is not PD."""
    h = hessian.float().clone()
    dead = weight.eq(0).all(dim=0)
    h[dead, :] = 0
    h[:, dead] = 0
    h[dead, dead] = 1
    idx = torch.arange(h.shape[0], device=h.device)
    h[idx, idx] += perc_damp * torch.diag(h).mean()
    try:
        return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except (RuntimeError, torch.linalg.LinAlgError):
        return torch.eye(h.shape[0], device=h.device, dtype=h.dtype)


def _round_columns(cols: Tensor, eff: Tensor) -> Tensor:
    """E2M1-round ``cols / eff`` and scale back (fp32), elementwise: the fixed-scale NVFP4 value."""
    q = (cols / eff).contiguous()
    keys = _e2m1_keys(q.clone())
    return _table("key_value", cols.device)[keys] * eff


def nvfp4_gptq(
    weight: Tensor, hessian: Tensor, global_scale: Tensor, block_scale: Tensor,
    perc_damp: float = 0.01, block_size: int = 128,
) -> Tensor:
    """GPTQ-updated dequantized weight ``[out, in]`` fp32 under fixed ``global_scale`` and e4m3
    ``block_scale [out, in/16]``; ``hessian [in, in]``."""
    out_f, in_f = weight.shape
    if in_f % NVFP4_BLOCK or tuple(block_scale.shape) != (out_f, in_f // NVFP4_BLOCK):
        raise ValueError(f"block_scale must be [{out_f}, {in_f // NVFP4_BLOCK}] for weight {tuple(weight.shape)}, "
                         f"got {tuple(block_scale.shape)}")
    if tuple(hessian.shape) != (in_f, in_f):
        raise ValueError(f"hessian must be [{in_f}, {in_f}], got {tuple(hessian.shape)}")
    if block_size <= 0 or block_size % NVFP4_BLOCK:
        raise ValueError(f"block_size must be a positive multiple of {NVFP4_BLOCK}, got {block_size}")
    w = weight.detach().float().clone()
    h_inv = gptq_hessian_inverse(hessian.to(w.device), w, perc_damp)
    # Effective scale of every element's block, expanded per column: [out, in].
    eff = (block_scale.float() * global_scale.float().reshape(())).repeat_interleave(NVFP4_BLOCK, dim=1)
    for start in range(0, in_f, block_size):
        stop = min(start + block_size, in_f)
        h_blk = h_inv[start:stop, start:stop]
        errs = torch.zeros(out_f, stop - start, device=w.device)
        for i in range(stop - start):
            j = start + i
            col = w[:, j].clone()
            qcol = _round_columns(col, eff[:, j])
            w[:, j] = qcol
            err = (col - qcol) / h_blk[i, i]
            w[:, j + 1:stop] -= err[:, None] * h_blk[i, i + 1:][None, :]
            errs[:, i] = err
        w[:, stop:] -= errs @ h_inv[start:stop, stop:]
    return w


def gptq_hessian_inverse_batched(hessian: Tensor, weight: Tensor, perc_damp: float) -> Tensor:
    """``gptq_hessian_inverse`` of each of ``E`` experts at once: ``hessian [E, in, in]``, ``weight [E, out, in]``
    -> ``[E, in, in]`` fp32. Dead columns and damping per expert; an expert whose Hessian (or the inverse) has no
    Cholesky factor (``cholesky_ex``'s ``info``) gets the identity, the others are unaffected."""
    h = hessian.float().clone()
    dead = weight.eq(0).all(dim=-2)  # [E, in]
    h.masked_fill_(dead[:, :, None] | dead[:, None, :], 0)
    diag = h.diagonal(dim1=-2, dim2=-1)  # a view: writes go to h
    diag.masked_fill_(dead, 1)
    # The mean over a contiguous copy: the strided diagonal would be summed in another order than torch.diag's.
    diag += perc_damp * diag.contiguous().mean(dim=-1, keepdim=True)
    eye = torch.eye(h.shape[-1], device=h.device, dtype=h.dtype)
    # Each step frees the one before (``del``): at most two [E, in, in] beside the input, LAPACK's copies aside.
    factor, info = torch.linalg.cholesky_ex(h)
    del h, diag
    failed = info.ne(0)
    factor[failed] = eye  # no NaNs from a partial factor into the inverse
    inverse = torch.cholesky_inverse(factor)
    del factor
    factor, info = torch.linalg.cholesky_ex(inverse, upper=True)
    del inverse
    failed |= info.ne(0)
    factor[failed] = eye
    return factor


def gptq_batch_bytes(out_features: int, in_features: int, block_size: int = 128) -> int:
    """Peak working memory of ``nvfp4_gptq_batched`` per expert (bytes), beside its inputs, from the fp32 tensors
    it holds at once: three ``[in, in]`` while factorizing (the damped copy and a factor, LAPACK's copy of it);
    then the inverse's factor with three ``[out, in]`` (the updated weight, the effective scales and the column
    block's update of the later columns, or the scales' untransposed copy), and two ``[out, block]`` errors."""
    square, rect = in_features * in_features, out_features * in_features
    return 4 * (max(3 * square, square + 3 * rect) + 2 * out_features * block_size)


def nvfp4_gptq_batched(
    weight: Tensor, hessian: Tensor, global_scale: Tensor, block_scale: Tensor,
    perc_damp: float = 0.01, block_size: int = 128,
) -> Tensor:
    """``nvfp4_gptq`` of ``E`` same-shape experts in one pass: ``weight [E, out, in]``, ``hessian [E, in, in]``,
    ``global_scale`` one per expert (``[E]``, any shape of ``E`` elements), e4m3 ``block_scale [E, out, in/16]``
    -> the dequantized updated weights ``[E, out, in]`` fp32, each equal to ``nvfp4_gptq`` of its expert.

    Memory: ``gptq_batch_bytes(out, in, block_size)`` per expert beside the inputs; callers bound it by chunking
    the experts."""
    if weight.dim() != 3:
        raise ValueError(f"weight must be [experts, out, in], got {tuple(weight.shape)}")
    n_exp, out_f, in_f = weight.shape
    if in_f % NVFP4_BLOCK or tuple(block_scale.shape) != (n_exp, out_f, in_f // NVFP4_BLOCK):
        raise ValueError(f"block_scale must be [{n_exp}, {out_f}, {in_f // NVFP4_BLOCK}] for weight "
                         f"{tuple(weight.shape)}, got {tuple(block_scale.shape)}")
    if tuple(hessian.shape) != (n_exp, in_f, in_f):
        raise ValueError(f"hessian must be [{n_exp}, {in_f}, {in_f}], got {tuple(hessian.shape)}")
    if global_scale.numel() != n_exp:
        raise ValueError(f"global_scale must hold one scale per expert ({n_exp}), got {tuple(global_scale.shape)}")
    if block_size <= 0 or block_size % NVFP4_BLOCK:
        raise ValueError(f"block_size must be a positive multiple of {NVFP4_BLOCK}, got {block_size}")
    device = weight.device
    w = weight.detach().float()  # dead columns as the loop finds them: on the fp32 values
    h_inv = gptq_hessian_inverse_batched(hessian.to(device), w, perc_damp)
    gs = global_scale.float().reshape(n_exp, 1, 1).to(device)
    # Columns as rows ([E, in, out]): a column's reads and writes, and the rank-1 updates, run over contiguous
    # memory. Elementwise ops give the same bits in any layout; the block products below keep the loop's layout.
    # Always a copy (``clone``), never the caller's storage, whatever its layout.
    w_t = w.transpose(1, 2).clone(memory_format=torch.contiguous_format)
    del w
    eff_t = (block_scale.float() * gs).repeat_interleave(NVFP4_BLOCK, dim=-1).transpose(1, 2).contiguous()
    for start in range(0, in_f, block_size):
        stop = min(start + block_size, in_f)
        h_blk = h_inv[:, start:stop, start:stop]
        errs_t = torch.empty(n_exp, stop - start, out_f, device=device)
        for i in range(stop - start):
            j = start + i
            col = w_t[:, j].clone()
            qcol = _round_columns(col, eff_t[:, j])
            w_t[:, j] = qcol
            err = (col - qcol) / h_blk[:, i, i, None]
            w_t[:, j + 1:stop] -= h_blk[:, i, i + 1:, None] * err[:, None, :]
            errs_t[:, i] = err
        # The loop's product on the loop's layouts (errors [E, out, block] contiguous), so the same bits.
        errs = errs_t.transpose(1, 2).contiguous()
        w_t[:, stop:] -= (errs @ h_inv[:, start:stop, stop:]).transpose(1, 2)
    return w_t.transpose(1, 2).contiguous()


def asymmetric_target(weight: Tensor, sum_yy: Tensor, sum_xy: Tensor, perc_damp: float = 0.01) -> Tensor:
    """``W + W D (H̃ + damp I)⁻¹`` ``[out, in]`` fp32: the weight whose GPTQ under ``H̃`` minimises ``||W X - Ŵ Y||``.

    ``sum_yy = Σ y yᵀ`` over the Linear's own inputs ``y``, ``sum_xy = Σ x yᵀ`` with ``x`` the reference
    (unquantized model's) input of the same call, ``D = sum_xy - sum_yy`` (``[in, in]``, unscaled: the token
    count cancels). The damping is GPTQ's (``perc_damp * mean(diag)``), so the objectives agree. float64 solve;
    ``weight`` unchanged where the system is singular or ``x == y`` everywhere."""
    in_f = weight.shape[-1]
    if tuple(sum_yy.shape) != (in_f, in_f) or tuple(sum_xy.shape) != (in_f, in_f):
        raise ValueError(f"sums must be [{in_f}, {in_f}], got {tuple(sum_yy.shape)} and {tuple(sum_xy.shape)}")
    h = sum_yy.double()
    d = sum_xy.double() - h
    if not bool(d.any()):
        return weight.detach().float().clone()
    h = h + perc_damp * torch.diag(h).mean() * torch.eye(in_f, dtype=h.dtype, device=h.device)
    w = weight.detach().double().to(h.device)
    try:
        shift = torch.linalg.solve(h, (w @ d).T).T  # (W D) H⁻¹, H symmetric
    except (RuntimeError, torch.linalg.LinAlgError):
        return weight.detach().float().clone()
    if not bool(torch.isfinite(shift).all()):
        return weight.detach().float().clone()
    return (w + shift).float().to(weight.device)
