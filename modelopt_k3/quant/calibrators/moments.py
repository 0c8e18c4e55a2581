"""Rank-independent input second moments ``sum x xᵀ`` (float64, exact in any summation order), the statistic
of the Hessian-weighted algorithms (``local_hessian``, ``gptq``).

Dense Linears are replicated: each rank sums its own tokens, then one all-reduce (``reduce_moments``).
Routed experts: each local expert's sums are taken by its owner from the (token, slot) pairs routed to it as
they reach it (``experts.dispatch.owner_inputs``: after ``torch_a2a``'s exchange; ``ExpertSums``), nothing per
expert travels to other experts' owners; where several ranks hold the same experts (replicated expert groups)
their sums are added up among those ranks (``ExpertSums.reduce_over_replicas``). The gate/up projection's input is the routed hidden state as the owner receives it (after the
experts' input quantizer, which runs at the origin); the down projection's is recomputed there from those
tokens (gate/up in effect, the model's activation, the down input quantizer): the inputs the expert GEMMs
multiply.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack

import torch
import torch.distributed as dist
from torch import nn

from ...dist.collectives import run_together
from ...dist.group import current_group
from ...experts.dispatch import owner_inputs
from ...experts.packed import is_packed
from ...numerics.constants import NVFP4_BLOCK
from ..modules import ExpertsQuantState, set_mode
from ..schemes import NVFP4_TENSOR
from .base import ForwardLoop

EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # the fused experts' projections, in the order they run

HI_BITS = 14  # x = hi * g1 + lo * g2 + r, |hi|, |lo| <= 2**14 (about), |r| <= 2**-29 * amax
MAX_EXACT_TOKENS = 1 << 21  # integer-valued float64 sums of hi*hi stay below 2**53 up to here


class Accumulator:
    """``sum x xᵀ`` and the token count: per block ``[in/16, 16, 16]`` or full ``[in, in]``.

    Rank-independent: ``x`` is split on a power-of-two grid set by the Linear's calibrated input amax
    (the same on every rank) into integer-valued ``hi`` and ``lo``; sums of their products are exact
    in float64 whatever the order, so 1 process and N ranks get the same bits. ``x xᵀ`` is then
    ``hi hiᵀ g1² + (hi loᵀ + lo hiᵀ) g1 g2`` (the ``lo loᵀ`` term, below 2**-56 amax², is dropped).
    """

    def __init__(self, blocks: bool, amax: float) -> None:
        self.blocks = blocks
        e = math.ceil(math.log2(amax)) if amax > 0 and math.isfinite(amax) else 0
        self.g1, self.g2 = 2.0 ** (e - HI_BITS), 2.0 ** (e - 2 * HI_BITS)
        self.hh: torch.Tensor | None = None
        self.hl: torch.Tensor | None = None
        self.tokens = 0

    def _outer(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.blocks:
            return torch.einsum("tnb,tnd->nbd", a, b)
        return a.T @ b

    def add(self, x: torch.Tensor) -> None:
        n_in = x.shape[-1]
        shape = (-1, n_in // NVFP4_BLOCK, NVFP4_BLOCK) if self.blocks else (-1, n_in)
        x = x.detach().reshape(shape).to(torch.float64)
        hi = torch.round(x / self.g1)
        lo = torch.round((x - hi * self.g1) / self.g2)
        hh, hl = self._outer(hi, hi), self._outer(hi, lo)
        self.hh = hh if self.hh is None else self.hh + hh
        self.hl = hl if self.hl is None else self.hl + hl
        self.tokens += x.shape[0]

    def combine(self, hh: torch.Tensor, hl: torch.Tensor) -> torch.Tensor:
        """``sum x xᵀ`` from the (reduced) integer-valued sums."""
        cross = hl + hl.transpose(-1, -2)
        return hh * (self.g1 * self.g1) + cross * (self.g1 * self.g2)


def nvfp4_linears(model: nn.Module) -> dict[int, nn.Linear]:
    """The dense Linears with an NVFP4 weight quantizer, by ``id``, in module order."""
    return {id(m): m for m in model.modules()
            if type(m) is nn.Linear and getattr(m, "weight_quantizer", None) is not None
            and m.weight_quantizer.fmt is NVFP4_TENSOR}


def input_moments(model: nn.Module, forward_loop: ForwardLoop, *, blocks: bool, raw_input: bool,
                  experts: dict[int, tuple[nn.Module, dict[str, ExpertSums]]] | None = None,
                  ) -> dict[int, tuple[torch.Tensor, int]]:
    """One forward with activations fake-quantized and weights not: per dense NVFP4 Linear the sum of
    ``x xᵀ`` over every rank's tokens (float64, all-reduced) and the token count. ``raw_input``: the
    Linear's input as it arrives (before its own input quantizer), else as that quantizer leaves it.
    ``experts``: fused experts modules (by ``id``) whose owners add, in the same forward, each local expert's
    inputs to the module's ``ExpertSums`` (``expert_observer``; kept per rank, nothing reduced)."""
    linears = nvfp4_linears(model)
    accs = {key: Accumulator(blocks, input_amax(m)) for key, m in linears.items()}
    handles = [m.register_forward_pre_hook(lambda mod, args, a=accs[key]: a.add(args[0]), prepend=raw_input)
               for key, m in linears.items()]
    set_mode(model, "off", role="weight")
    try:
        with ExitStack() as observing:
            for module, sums in (experts or {}).values():
                observing.enter_context(owner_inputs(module, expert_observer(lambda sums=sums: sums)))
            run_together("second-moment forward", forward_loop, model)
    finally:
        for h in handles:
            h.remove()
        set_mode(model, "quant")
    return reduce_moments(accs, linears, blocks)


def input_amax(linear: nn.Linear) -> float:
    """The Linear's calibrated input amax (identical on every rank), else its weight's amax (weight-only)."""
    q = linear.input_quantizer
    if q is not None and q.calibrated:
        return float(q.amax.max())
    return float(linear.weight_quantizer.amax.max())


def sums_shape(n_in: int, blocks: bool) -> tuple[int, ...]:
    """The shape of one Linear's (or expert projection's) ``x xᵀ`` sums: per 16-block, or full."""
    return (n_in // NVFP4_BLOCK, NVFP4_BLOCK, NVFP4_BLOCK) if blocks else (n_in, n_in)


def _packed(acc: Accumulator | None, shape: tuple[int, ...]) -> torch.Tensor:
    """``acc``'s hi/lo sums and token count as one flat float64 tensor (zeros where no token reached it)."""
    if acc is None:
        return torch.zeros(2 * math.prod(shape) + 1, dtype=torch.float64)
    parts = [torch.zeros(shape, dtype=torch.float64) if p is None else p.cpu() for p in (acc.hh, acc.hl)]
    return torch.cat([p.reshape(-1) for p in parts] + [torch.tensor([float(acc.tokens)], dtype=torch.float64)])


def _unpacked(buf: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``_packed``'s inverse: (hh, hl, tokens)."""
    size = math.prod(shape)
    return buf[:size].reshape(shape), buf[size:2 * size].reshape(shape), int(buf[2 * size])


def _summed(buf: torch.Tensor, group) -> torch.Tensor:
    """``buf`` all-reduced over ``group``: integer-valued float64 sums, exact in any order."""
    buf = buf.to(current_group().device)
    dist.all_reduce(buf, group=group)
    return buf.cpu()


def _check_exact(tokens: int, what: str) -> None:
    if tokens > MAX_EXACT_TOKENS:
        raise ValueError(f"{tokens} calibration tokens reached one {what}; rank-independent Hessian sums are "
                         f"exact up to {MAX_EXACT_TOKENS}: calibrate on fewer tokens")


def reduce_moments(accs: dict[int, Accumulator], linears: dict[int, nn.Module], blocks: bool,
                   ) -> dict[int, tuple[torch.Tensor, int]]:
    """Sum every rank's moments and token counts: one flat float64 all-reduce, in module order."""
    if not accs:
        return {}
    g = current_group()
    shapes = {k: sums_shape(m.in_features, blocks) for k, m in linears.items()}
    buf = torch.cat([_packed(acc, shapes[k]) for k, acc in accs.items()])
    if g.world_size > 1:
        buf = _summed(buf, g.pg)
    out, pos = {}, 0
    for k, acc in accs.items():
        n = 2 * math.prod(shapes[k]) + 1
        hh, hl, tokens = _unpacked(buf[pos:pos + n], shapes[k])
        pos += n
        _check_exact(tokens, "Linear")
        out[k] = (acc.combine(hh, hl), tokens)
    return out


def expert_input_amax(state: ExpertsQuantState, param: str, expert: int) -> float:
    """The split grid of one expert's input sums: its input quantizer's amax (the same on every rank), else the
    expert's weight amax (weight-only)."""
    q = state.input[param] if param in state.input else None
    if q is not None and q.calibrated:
        return float(q.amax.max())
    return float(state.weight[param].amax[expert])


class ExpertSums:
    """One fused projection's input sums, per local expert (``Accumulator``: per 16-block or full)."""

    def __init__(self, state: ExpertsQuantState, param: str, blocks: bool) -> None:
        self.state, self.param, self.blocks = state, param, blocks
        self.by_expert: dict[int, Accumulator] = {}

    def add(self, expert: int, x: torch.Tensor) -> None:
        acc = self.by_expert.get(expert)
        if acc is None:
            acc = self.by_expert[expert] = Accumulator(self.blocks, expert_input_amax(self.state, self.param, expert))
        acc.add(x)

    def pop(self, expert: int) -> tuple[torch.Tensor, int] | None:
        """Local expert ``expert``'s ``(sum x xᵀ, tokens)``, dropped from here; None if no token reached it."""
        acc = self.by_expert.pop(expert, None)
        if acc is None or acc.tokens == 0:
            return None
        _check_exact(acc.tokens, "expert")
        return acc.combine(acc.hh, acc.hl), acc.tokens

    def clear(self) -> None:
        self.by_expert.clear()

    def reduce_over_replicas(self, module: nn.Module) -> None:
        """Sum every local expert's sums over the ranks that hold the same experts (``placement.replicas``:
        replicated expert groups, each replica with its own tokens), one expert at a time; exact, as the sums are
        integer-valued. Nothing where no other rank holds them."""
        replicas = module.placement.replicas
        if replicas is None or dist.get_world_size(replicas) == 1:
            return
        shape = sums_shape(getattr(module, self.param).shape[-1], self.blocks)
        for e in range(module.num_experts):  # every local expert, on every replica: the same collectives
            hh, hl, tokens = _unpacked(_summed(_packed(self.by_expert.get(e), shape), replicas), shape)
            if tokens == 0:
                self.by_expert.pop(e, None)
                continue
            acc = self.by_expert.get(e)
            if acc is None:
                acc = self.by_expert[e] = Accumulator(self.blocks, expert_input_amax(self.state, self.param, e))
            acc.hh, acc.hl, acc.tokens = hh, hl, tokens


def owner_observes(module: nn.Module, param: str) -> bool:
    """Whether ``expert_observer`` can give this fused projection's inputs: decoded-resident experts of the known
    layout (``EXPERT_PARAMS``, with the model's ``activation`` between them)."""
    return not is_packed(module) and param in EXPERT_PARAMS and hasattr(module, "activation")


def expert_observer(wanted: Callable[[], dict[str, ExpertSums]]):
    """The owner hook (``owner_inputs``) of one experts module: each routed local expert's gate/up input and,
    recomputed from it with the weights in effect, its down input, added to the sums ``wanted()`` names."""

    def hook(module: nn.Module, hidden: torch.Tensor, local_ids: torch.Tensor) -> None:
        sums = wanted()
        if not sums or hidden.shape[0] == 0:
            return
        state: ExpertsQuantState = module.quant
        k = local_ids.shape[-1]
        flat = local_ids.reshape(-1)
        rows = torch.arange(local_ids.shape[0], device=flat.device).repeat_interleave(k)
        present = flat[(flat >= 0) & (flat < module.num_experts)]
        for e in torch.unique(present).tolist():
            x = hidden[rows[flat == e]]
            if "gate_up_proj" in sums:
                sums["gate_up_proj"].add(e, x)
            if "down_proj" in sums:
                w = module.gate_up_proj[e]
                bias = module.gate_up_proj_bias[e] if getattr(module, "has_bias", False) else None
                h = module.activation(nn.functional.linear(x.to(w.dtype), w, bias))
                dq = state.input["down_proj"] if "down_proj" in state.input else None
                if dq is not None and dq.mode == "quant":
                    h = dq.fake_quant(h)  # what down_input_hook applies (without counting the tokens again)
                sums["down_proj"].add(e, h)

    return hook
