"""``max`` calibration: weight amax from the weights, activation amax from a forward loop.

Distribution rules (FORMATS.md, DESIGN.md): dense quantizers' amax is max-reduced over all ranks
(each rank saw its own share of the data); expert weight amax stays with the owner (weights differ per
expert); expert input amax is one value per MoE layer and projection, max-reduced over all ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.nonfinite import PASSTHROUGH_FLAG, NonFiniteError
from ..dist.collectives import all_reduce_max_, run_together
from ..dist.group import current_group
from ..experts.packed import local_experts_forward
from .modules import ExpertsQuantState, iter_quantizers, set_mode


def _all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0 (row counts may differ)."""
    g = current_group()
    if g.world_size == 1:
        return x
    n = torch.tensor([x.shape[0]], device=x.device)
    counts = [torch.zeros_like(n) for _ in range(g.world_size)]
    dist.all_gather(counts, n, group=g.pg)
    counts_l = [int(c) for c in counts]
    padded = x.new_zeros((max(counts_l), *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = [torch.empty_like(padded) for _ in counts_l]
    dist.all_gather(out, padded.contiguous(), group=g.pg)
    return torch.cat([o[:c] for o, c in zip(out, counts_l)])


def _calibrate_all_experts_hook(experts: nn.Module, state: ExpertsQuantState):
    """Pre-hook: during calibration, push every token (of every rank) through every local expert.

    The routed forward that follows is unchanged, so the model's output is the model's own.
    """
    # Below the interface dispatch: local ids, this rank only (packed experts decode around it).
    eager = local_experts_forward(experts, "eager")

    def hook(module, args, kwargs):
        if not state.calibrate_all_experts or not any(q.mode == "calib" for q in state.input.values()):
            return None
        x = _all_gather_rows(args[0])
        n, e = x.shape[0], module.num_experts
        ids = torch.arange(e, device=x.device).expand(n, e)
        eager(module, x, ids, torch.zeros(n, e, dtype=torch.float32, device=x.device))
        return None

    return hook


def enable_calibrate_all_experts(model: nn.Module) -> None:
    for module in model.modules():
        state = getattr(module, "quant", None)
        if isinstance(state, ExpertsQuantState) and not state.calibrate_all_experts:
            state.calibrate_all_experts = True
            # Registered after the input-quantizer hook, so x here is already observed by it.
            module.register_forward_pre_hook(_calibrate_all_experts_hook(module, state), with_kwargs=True)


def sync_amax(model: nn.Module) -> None:
    """Max-reduce activation amax over ranks. Weight amax stays local (replicated or owned)."""
    g = current_group()
    if g.world_size == 1:
        return
    inputs = [q for _, q in iter_quantizers(model) if q.role == "input" and q.constant_amax is None]
    if not inputs:
        return
    # One collective for all of them; NaN (never observed here) must not poison the max. An observed
    # NaN is +Inf by now (TensorQuantizer.observe), which the max keeps.
    flat = torch.stack([q.amax.reshape(()) for q in inputs]).to(g.device)
    flat = torch.where(torch.isnan(flat), -1.0, flat)
    all_reduce_max_(flat, group=g)
    for q, value in zip(inputs, flat.tolist()):
        q.amax.fill_(float("nan") if value < 0 else value)


@torch.no_grad()
def calibrate(model: nn.Module, forward_loop: Callable[[nn.Module], None] | None) -> None:
    """Run ``forward_loop`` with input quantizers observing, then switch every quantizer to ``quant``
    (the max calibrator's observe, reduce and checks; quant/calibrators/max.py sequences them)."""
    observe_inputs(model, forward_loop)
    sync_amax(model)
    check_calibrated(model)
    set_mode(model, "quant")


@torch.no_grad()
def observe_inputs(model: nn.Module, forward_loop: Callable[[nn.Module], None] | None) -> None:
    """Run ``forward_loop`` with every input quantizer recording its running max (when any needs data)."""
    needs_data = any(q.role == "input" and q.constant_amax is None for _, q in iter_quantizers(model))
    if not needs_data:
        return
    if forward_loop is None:
        raise ValueError("the recipe quantizes activations without a constant amax: a forward_loop is required")
    set_mode(model, "calib", role="input")
    try:
        run_together("calibration forward", forward_loop, model)
    finally:
        set_mode(model, "off")


def check_calibrated(model: nn.Module) -> None:
    """Refuse NaN/Inf seen in calibration and quantizers no data reached."""
    nonfinite = [name for name, q in iter_quantizers(model) if q.saw_nonfinite]
    if nonfinite:
        raise NonFiniteError(
            "calibration observed values that are not numbers (NaN/Inf)",
            {name: _nonfinite_what(q) for name, q in iter_quantizers(model) if q.saw_nonfinite},
            "the weights or activations there are not finite: a NaN/Inf weight (load refuses those unless "
            f"{PASSTHROUGH_FLAG}) or activations beyond the model dtype's range; check the checkpoint",
        )
    missing = [name for name, q in iter_quantizers(model) if q.fmt.per_tensor_scale and not q.calibrated]
    if missing:
        raise RuntimeError(
            "no calibration data reached these quantizers (more data or calibrate_all_experts helps): "
            + ", ".join(missing[:10])
        )


def _nonfinite_what(q) -> str:
    if q.amax.dim() == 0:
        return f"{q.role} amax"
    bad = torch.isinf(q.amax).nonzero().flatten().tolist()
    return f"{q.role} amax of {len(bad)} expert(s), local ids {bad[:8]}"


@torch.no_grad()
def share_group_amax(model: nn.Module, groups: dict[str, tuple[str, ...]]) -> None:
    """Every shared-input group takes its max weight amax and max input amax (ModelOpt's
    ``preprocess_linear_fusion``), so its members export one ``weight_scale_2`` and one ``input_scale``
    and the fake-quant forward uses them. Amax is already the same on every rank (weights are full,
    inputs were max-reduced), so this needs no collective."""
    modules = dict(model.named_modules())
    for members in groups.values():
        linears = [modules[m] for m in members]
        for role in ("weight_quantizer", "input_quantizer"):
            quantizers = [getattr(m, role) for m in linears if getattr(m, role) is not None]
            if quantizers:
                shared = torch.stack([q.amax.reshape(()) for q in quantizers]).amax()
                for q in quantizers:
                    q.amax.copy_(shared.to(q.amax.device))
