"""AWQ's folds into a Linear's output rows (v -> o_proj, up -> down_proj): the groups that read no norm.

``awq.py`` smooths what reads a norm; the inputs of o_proj (attention over v) and of down_proj (``act(gate) * up``)
come from another Linear's output rows. Scaling those rows by ``1/s`` and the consumer's input columns by ``s`` is
exact when each consumer input channel is one producer row times a function of other rows. Nothing is named per
model: the pairs are found from the forward (llm-compressor names them, ``v_proj -> o_proj`` and
``up_proj -> down_proj``, and skips GQA's v -> o; here GQA's repeated o channels share their v row's ``s``):

- **dense** (attention, dense MLPs, shared experts): a module with two or more quantized Linear children, holding
  no routed experts, is re-run once on its first calibration input (KV caches dropped) with each child's weight
  doubled; a child whose input then doubles exactly is a producer, and ``numerics.awq.probe_row_map`` maps each
  consumer input channel to its producer row by more such re-runs with row subsets doubled (powers of two: exact).
  q and k fail (the softmax), the gate fails (``act(2g) != 2 act(g)``), MLA's kv_b_proj fails (it also makes k):
  no fold for MLA, by the probe, not by name.
- **routed experts** (fused ``gate_up_proj [E, 2I, H]`` -> ``down_proj [E, H, I]``): the module's own
  ``activation(gate_up)`` is probed on the first routed tokens' gate_up outputs; ONE ``s`` PER EXPERT, its
  statistic and loss on the tokens routed to it, on its owner (no reduction over ranks: each expert has one).

Statistics and losses are AWQ's (``numerics/awq.py``; the consumer alone in the loss, its own global scale,
per expert for routed experts); dense pairs' sums are reduced over ranks as the norm groups' are. Not folded (said
in ``smoothing`` and the consumer's label): a producer with a bias, a non-NVFP4 or source-byte (FP8/MXFP4) member,
FSDP2-sharded or packed weights, a module whose probe finds no one-to-one map.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ...dist.fsdp import is_sharded
from ...dist.group import current_group
from ...experts.dispatch import owner_inputs
from ...experts.packed import is_packed
from ...numerics.awq import (
    LIMBS,
    abs_sum_limbs,
    awq_scales,
    block_normalised_row_sums,
    limbs_to_sum,
    probe_row_map,
    rows_of,
)
from ...numerics.constants import NVFP4_BLOCK
from ...numerics.nvfp4 import nvfp4_fake_quant, nvfp4_global_scale
from ..modules import ExpertsQuantState
from ..schemes import NVFP4_TENSOR

GATE_UP, DOWN = "gate_up_proj", "down_proj"
EXPERT_PROBE_TOKENS = 16  # rows of the fixed N(0, 1) batch an experts module's activation is probed on
Candidate = tuple[float, bool]  # (alpha, duo), as awq.py's


@dataclass(eq=False)
class LinearPair:
    """A producer whose output rows are a consumer's input channels (``row_map``); ``E`` is 1 for a dense pair,
    the local experts for a routed one (one ``s`` each)."""

    producer: str  # dense: the producer Linear's name; routed: the experts module's ``.gate_up_proj``
    consumer: str  # the consumer's weight quantizer name (the labels' key)
    p_module: nn.Module
    c_module: nn.Module
    experts: bool
    across_tokens: bool  # the consumer's input at a token also reads other tokens' producer rows (v -> o)
    row_map: torch.Tensor  # [C] int64: the producer row of each consumer input channel
    limbs: torch.Tensor  # [E, LIMBS, C] float64 integer-valued |x| limb sums
    tokens: torch.Tensor  # [E] float64
    losses: torch.Tensor | None = None  # [E, candidates] float64
    mean: torch.Tensor | None = None  # [E, R] mean|x| per mapped row
    weight_mean: torch.Tensor | None = None  # [E, R] (duo)
    choice: list[int] | None = None  # per expert: the chosen candidate's index

    @property
    def name(self) -> str:
        return f"{self.producer} -> {self.consumer}"

    @property
    def mapped(self) -> torch.Tensor:
        """``[R]``: the producer rows some consumer channel maps to, ascending."""
        return torch.unique(self.row_map)

    @property
    def inverse(self) -> torch.Tensor:
        """``[C]``: each consumer channel's index into ``mapped``."""
        return torch.unique(self.row_map, return_inverse=True)[1]

    def scales(self, candidate: Candidate) -> torch.Tensor:
        """``[E, R]`` float32 smoothing scales of the mapped rows for ``candidate`` (every expert's own)."""
        alpha, duo = candidate
        return torch.stack([awq_scales(self.mean[e], alpha, self.weight_mean[e] if duo else None)
                            for e in range(self.mean.shape[0])])

    def consumer_weight(self) -> torch.Tensor:
        """``[E, out, C]``: the consumer's weight, a dense one with a leading expert dim of 1."""
        w = getattr(self.c_module, DOWN) if self.experts else self.c_module.weight
        return w.detach() if self.experts else w.detach().unsqueeze(0)


def _first_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    x = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
    return x if isinstance(x, torch.Tensor) else None


def _quantized_linears(m: nn.Module) -> dict[str, nn.Linear]:
    return {n: c for n, c in m.named_children() if isinstance(c, nn.Linear) and
            getattr(c, "weight_quantizer", None) is not None}


def is_nvfp4_linear(m: nn.Module) -> bool:
    """A Linear whose weight is quantized to NVFP4 from the model's values (not written as its source bytes):
    a weight AWQ can scale (its norm groups and its pairs alike)."""
    q = getattr(m, "weight_quantizer", None)
    return type(m) is nn.Linear and q is not None and q.fmt is NVFP4_TENSOR and q.block_source is None


def _holds_experts(m: nn.Module) -> bool:
    return any(isinstance(getattr(d, "quant", None), ExpertsQuantState) for d in m.modules())


def _without_caches(kwargs: dict) -> dict:
    """A re-run must not append to the forward's KV cache: every cache argument is dropped (None)."""
    from transformers.cache_utils import Cache

    return {k: (None if isinstance(v, Cache) else v) for k, v in kwargs.items()}


class _RowScaled:
    """A Linear's output rows (its weight's rows and its bias) times ``c`` (powers of two: exact both ways)."""

    def __init__(self, linear: nn.Linear, c: torch.Tensor) -> None:
        w = linear.weight
        self.params = [(w, c.to(w.device, w.dtype).unsqueeze(-1))]
        if linear.bias is not None:
            self.params.append((linear.bias, c.to(w.device, linear.bias.dtype)))

    def __enter__(self) -> None:
        with torch.no_grad():
            for p, c in self.params:
                p.mul_(c)

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            for p, c in self.params:
                p.div_(c)


class PairFinder:
    """Pass 1's share of the folds: finds the pairs on the first call of each candidate module, then sums the
    consumers' ``|x|`` limbs. ``probing`` is set while a module is re-run, so that no statistic hook counts it."""

    def __init__(self, model: nn.Module, v_o: bool, up_down: bool) -> None:
        self.model = model
        self.v_o, self.up_down = v_o, up_down  # which kinds are folded (the others are found and said not to be)
        self.probing = False
        self.pairs: dict[str, LinearPair] = {}
        self.skipped: dict[str, str] = {}  # a module or pair -> why no fold
        self.quantized_consumers: dict[str, list[str]] = {}  # skipped key -> the weights whose label says why
        self._stack: ExitStack | None = None

    def hooks(self, stack: ExitStack) -> None:
        """Register pass 1's hooks (removed when ``stack`` closes, with those registered as pairs are found)."""
        self._stack = stack
        for name, m in self.model.named_modules():
            state = getattr(m, "quant", None)
            if isinstance(state, ExpertsQuantState):
                if self.up_down:
                    self._experts_hooks(name, m, state, stack)
            elif len(_quantized_linears(m)) >= 2 and not _holds_experts(m):
                h = m.register_forward_pre_hook(self._discover_dense(name), with_kwargs=True)
                stack.callback(h.remove)

    # ---------------------------------------------------------------- dense

    def _discover_dense(self, parent: str):
        done = False

        def hook(mod, args, kwargs):
            nonlocal done
            if done or self.probing:
                return
            done = True
            linears = _quantized_linears(mod)
            if any(is_sharded(p) for p in mod.parameters()):
                self.skipped[parent] = "FSDP2-sharded weights (the probe and the fold need whole weights)"
                return
            self.probing = True
            try:
                found = self._probe_dense(mod, args, _without_caches(kwargs), linears)
            finally:
                self.probing = False
            for p_name, c_name, row_map, across in found:
                prefix = f"{parent}." if parent else ""
                self._add_dense(prefix + p_name, prefix + c_name, linears[p_name], linears[c_name], row_map, across)
        return hook

    @staticmethod
    def _probe_dense(mod: nn.Module, args: tuple, kwargs: dict,
                     linears: dict[str, nn.Linear]) -> list[tuple[str, str, torch.Tensor, bool]]:
        """(producer, consumer, row map, across tokens) of ``mod``'s Linear children: a consumer's input doubles
        exactly when the producer's weight doubles, and the rows map one to one (``probe_row_map``); across
        tokens: doubling the producer's output at the first token changes the consumer's input at others too
        (attention: v -> o), else the pair is token-wise (the MLP's ``act(gate) * up``: up -> down)."""
        def inputs(scaled: nn.Linear | None, c: torch.Tensor | None,
                   first_token: nn.Linear | None = None) -> dict[str, torch.Tensor]:
            seen: dict[str, torch.Tensor] = {}

            def capture(n: str):
                def hook(m, a, k):
                    seen.setdefault(n, _first_input(a, k).detach().clone())
                return hook

            handles = [lin.register_forward_pre_hook(capture(n), with_kwargs=True) for n, lin in linears.items()]
            if first_token is not None:
                handles.append(first_token.register_forward_hook(_first_token_doubled))
            try:
                with torch.no_grad(), (_RowScaled(scaled, c) if scaled is not None else ExitStack()):
                    mod.forward(*args, **kwargs)
            finally:
                for h in handles:
                    h.remove()
            return seen

        ref = inputs(None, None)
        found = []
        for p_name, p in linears.items():
            doubled = inputs(p, torch.full((p.out_features,), 2.0))
            for c_name in linears:
                x, y = ref.get(c_name), doubled.get(c_name)
                if c_name == p_name or x is None or y is None or not torch.equal(y, x * 2) or not bool(x.any()):
                    continue
                row_map = probe_row_map(lambda c, p=p, c_name=c_name: inputs(p, c).get(c_name), p.out_features)
                if row_map is not None:
                    moved = inputs(None, None, first_token=p)[c_name]
                    across = not torch.equal(moved.reshape(-1, moved.shape[-1])[1:], x.reshape(-1, x.shape[-1])[1:])
                    found.append((p_name, c_name, row_map, across))
        return found

    def _add_dense(self, producer: str, consumer: str, p: nn.Linear, c: nn.Linear, row_map: torch.Tensor,
                   across: bool) -> None:
        why = []
        if across and not self.v_o:
            why.append("its input mixes tokens (attention over v: the v -> o kind), off by default (fold_v_o)")
        elif not across and not self.up_down:
            why.append("a token-wise (up -> down) pair, and fold_up_down is off")
        for name, lin in ((producer, p), (consumer, c)):
            if not is_nvfp4_linear(lin):
                why.append(f"{name} is quantized as {lin.weight_quantizer.fmt} or from source bytes (not built)")
        if p.bias is not None:
            why.append(f"{producer} has a bias (its fold is not built)")
        key = f"{producer} -> {consumer}"
        if why:
            self.skipped[key] = "; ".join(why)
            self.quantized_consumers[key] = [consumer]
            return
        pair = LinearPair(producer, consumer, p, c, False, across, row_map,
                          torch.zeros(1, LIMBS, c.in_features, dtype=torch.float64),
                          torch.zeros(1, dtype=torch.float64))
        self.pairs[key] = pair

        def stats(mod, args, kwargs):
            x = _first_input(args, kwargs)
            if self.probing or x is None:
                return
            pair.limbs[0] += abs_sum_limbs(x).cpu()
            pair.tokens[0] += x.numel() // x.shape[-1]
        self._stack.callback(c.register_forward_pre_hook(stats, with_kwargs=True).remove)

    # ---------------------------------------------------------------- routed experts

    def _experts_hooks(self, name: str, m: nn.Module, state: ExpertsQuantState, stack: ExitStack) -> None:
        producer, consumer = f"{name}.{GATE_UP}", f"{name}.{DOWN}"
        key = f"{producer} -> {consumer}"
        why = self._experts_why(m, state)
        if why:
            self.skipped[key] = why
            self.quantized_consumers[key] = [consumer] if DOWN in state.weight else []
            return
        row_map = self._probe_experts(m)
        if row_map is None:
            self.skipped[key] = f"{type(m).__name__}.activation is no product with one {GATE_UP} row per {DOWN} " \
                                "input channel"
            self.quantized_consumers[key] = [consumer]
            return
        down = getattr(m, DOWN)
        pair = LinearPair(producer, consumer, m, m, True, False, row_map,
                          torch.zeros(m.num_experts, LIMBS, down.shape[-1], dtype=torch.float64),
                          torch.zeros(m.num_experts, dtype=torch.float64))

        def hook(module, hidden, local_ids):
            if self.probing or hidden.shape[0] == 0:
                return
            for e, h in routed_down_inputs(module, hidden, local_ids).items():
                pair.limbs[e] += abs_sum_limbs(h).cpu()
                pair.tokens[e] += h.shape[0]
        self.pairs[key] = pair
        stack.enter_context(owner_inputs(m, hook))

    @staticmethod
    def _experts_why(m: nn.Module, state: ExpertsQuantState) -> str | None:
        for param in (GATE_UP, DOWN):
            q = state.weight[param] if param in state.weight else None
            if q is None or q.fmt is not NVFP4_TENSOR:
                return f"its {param} is not NVFP4"
            if q.source is not None:
                return "MXFP4-sourced (the lossless cast keeps the source's bytes)"
        if is_packed(m) or any(is_sharded(getattr(m, p)) for p in (GATE_UP, DOWN)):
            return "packed-resident or sharded (the fold needs its decoded weights)"
        if getattr(m, "has_bias", False):
            return "the experts have biases (their fold is not built)"
        if not callable(getattr(m, "activation", None)):
            return f"{type(m).__name__} has no activation(gate_up) to probe"
        return None

    @staticmethod
    def _probe_experts(module: nn.Module) -> torch.Tensor | None:
        """The activation's map from ``gate_up`` rows to ``down`` input channels, probed on a fixed random batch
        (the same on every rank, before any token: every rank of a replica group finds the same pairs)."""
        w = getattr(module, GATE_UP)
        gen = torch.Generator().manual_seed(0)
        y = torch.randn(EXPERT_PROBE_TOKENS, w.shape[-2], generator=gen).to(w.device, w.dtype)
        with torch.no_grad():
            return probe_row_map(lambda c: module.activation(y * c.to(y.device, y.dtype)), w.shape[-2])


def _first_token_doubled(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    out = out.clone()
    out.view(-1, out.shape[-1])[0] *= 2
    return out


def routed_tokens(module: nn.Module, hidden: torch.Tensor, local_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """Local expert id -> the rows of ``hidden`` routed to it, in ascending expert order."""
    k = local_ids.shape[-1]
    flat = local_ids.reshape(-1)
    rows = torch.arange(local_ids.shape[0], device=flat.device).repeat_interleave(k)
    ids = torch.unique(flat[(flat >= 0) & (flat < module.num_experts)]).tolist()
    return {e: hidden[rows[flat == e]] for e in ids}


def routed_down_inputs(module: nn.Module, hidden: torch.Tensor, local_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """Local expert id -> its down projection's input on its routed tokens, as the eager forward computes it."""
    w = getattr(module, GATE_UP)
    return {e: module.activation(nn.functional.linear(x.to(w.dtype), w[e]))
            for e, x in routed_tokens(module, hidden, local_ids).items()}


# -------------------------------------------------------------------- after pass 1

def _summed(parts: list[torch.Tensor], group) -> list[torch.Tensor]:
    """``parts`` all-reduced (summed) over ``group`` as one buffer, each back in its shape."""
    g = current_group()
    buf = torch.cat([t.reshape(-1) for t in parts]).to(g.device)
    dist.all_reduce(buf, group=group)
    out, pos = [], 0
    for t in parts:
        out.append(buf[pos:pos + t.numel()].cpu().reshape(t.shape))
        pos += t.numel()
    return out


def _replicas(pairs: list[LinearPair]):
    """The group of ranks holding the same experts as this one (replicated expert groups), or None."""
    routed = [p for p in pairs if p.experts]
    replicas = routed[0].p_module.placement.replicas if routed else None
    return replicas if replicas is not None and dist.get_world_size(replicas) > 1 else None


def _check_same_pairs(pairs: list[LinearPair]) -> None:
    """Every rank found the same dense pairs (a data-dependent probe could differ: a buffer mismatch would hang)."""
    names = "\n".join(p.name for p in pairs if not p.experts)
    digest = torch.tensor([len(names), sum(names.encode()) % (1 << 40)], dtype=torch.float64)
    lo, hi = digest.clone().to(current_group().device), digest.clone().to(current_group().device)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=current_group().pg)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=current_group().pg)
    if not torch.equal(lo, hi):
        raise RuntimeError("awq: the ranks found different v->o / up->down pairs (a probe saw a zero channel on "
                           "one rank's first batch): calibrate with fold_up_down and fold_v_o off")


def reduce_pairs(pairs: list[LinearPair]) -> None:
    """Limb sums and token counts over ranks (integer-valued: exact): a dense pair's over every rank, a routed
    pair's over the ranks holding the same experts (replicated expert groups; alone on its owner otherwise)."""
    if current_group().world_size == 1:
        return
    _check_same_pairs(pairs)
    dense = [p for p in pairs if not p.experts]
    if dense:
        summed = _summed([t for p in dense for t in (p.limbs, p.tokens)], current_group().pg)
        for i, p in enumerate(dense):
            p.limbs, p.tokens = summed[2 * i], summed[2 * i + 1]
    routed, replicas = [p for p in pairs if p.experts], _replicas(pairs)
    if routed and replicas is not None:
        summed = _summed([t for p in routed for t in (p.limbs, p.tokens)], replicas)
        for i, p in enumerate(routed):
            p.limbs, p.tokens = summed[2 * i], summed[2 * i + 1]


def pair_means(pair: LinearPair, duo: bool) -> None:
    """``mean|x|`` per mapped row (GQA: over the o channels that repeat a v row) and, for duo, the consumer's
    ``mean|w~|`` per mapped row; an expert that saw no token gets zeros (its loss is 0: never folded)."""
    sums, counts = rows_of(pair.limbs, pair.row_map)  # [E, LIMBS, R]
    totals = torch.stack([limbs_to_sum(s) for s in sums])  # [E, R]
    pair.mean = totals / (pair.tokens.clamp(min=1).unsqueeze(-1) * counts)
    if duo:
        w = pair.consumer_weight()
        row_sums, _ = rows_of(block_normalised_row_sums(w, NVFP4_BLOCK).cpu(), pair.row_map)
        pair.weight_mean = row_sums / (counts * w.shape[-2])


def pair_plans(pair: LinearPair, candidates: list[Candidate]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per candidate: the consumer's column scales ``[E, C]`` and its smoothed weight's NVFP4 global scales
    ``[E]`` (each expert its own; a dense consumer its own ``weight_scale_2``)."""
    w = pair.consumer_weight()
    inverse = pair.inverse
    plans = []
    for cand in candidates:
        cols = pair.scales(cand)[:, inverse].to(w.device)
        amax = (w.float() * cols.unsqueeze(1)).abs().amax(dim=(1, 2))
        plans.append((cols, nvfp4_global_scale(amax)))
    return plans


def consumer_losses(weight: torch.Tensor, xs: dict[int, torch.Tensor], plans) -> torch.Tensor:
    """``[E, candidates]`` float64: per expert ``e`` in ``xs`` (e -> its consumer inputs), per candidate,
    ``|| fq(W_e diag(s_e)) (x / s_e) - W_e x ||²`` summed over its tokens; ``weight [E, out, C]``."""
    out = torch.zeros(weight.shape[0], len(plans), dtype=torch.float64)
    if not xs:
        return out
    w = weight.float()
    xs = {e: x.detach().reshape(-1, x.shape[-1]).float().to(w.device) for e, x in xs.items()}
    refs = {e: x @ w[e].T for e, x in xs.items()}
    for i, (cols, gs) in enumerate(plans):
        wq = nvfp4_fake_quant(w * cols.unsqueeze(1), gs.to(w.device).view(-1, 1, 1))
        for e, x in xs.items():
            out[e, i] = ((x / cols[e]) @ wq[e].T - refs[e]).double().pow(2).sum().cpu()
    return out


def loss_hooks(pair: LinearPair, plans, stack: ExitStack,
               owner_hooks: dict[nn.Module, list[Callable]]) -> None:
    """Pass 2's hooks of one pair: a dense consumer's pre-hook, or a routed pair's owner hook (``owner_hooks``:
    the calibrator registers one owner hook per experts module that calls them all)."""
    pair.losses = torch.zeros(pair.limbs.shape[0], len(plans), dtype=torch.float64)
    if pair.experts:
        def routed(module, hidden, local_ids):
            if hidden.shape[0]:
                pair.losses += consumer_losses(pair.consumer_weight(),
                                               routed_down_inputs(module, hidden, local_ids), plans)
        owner_hooks.setdefault(pair.p_module, []).append(routed)
        return

    def dense(mod, args, kwargs):
        x = _first_input(args, kwargs)
        if x is not None and x.numel():
            pair.losses += consumer_losses(pair.consumer_weight(), {0: x}, plans)
    h = pair.c_module.register_forward_pre_hook(dense, with_kwargs=True)
    stack.callback(h.remove)


def reduce_losses(pairs: list[LinearPair]) -> None:
    """Loss sums over ranks: a dense pair's over every rank, a routed pair's over its experts' replicas."""
    if current_group().world_size == 1:
        return
    dense = [p for p in pairs if not p.experts]
    if dense:
        for p, t in zip(dense, _summed([p.losses for p in dense], current_group().pg)):
            p.losses = t
    routed, replicas = [p for p in pairs if p.experts], _replicas(pairs)
    if routed and replicas is not None:
        for p, t in zip(routed, _summed([p.losses for p in routed], replicas)):
            p.losses = t


@torch.no_grad()
def fold_pair(pair: LinearPair, candidates: list[Candidate]) -> int:
    """Each chosen expert's (or the dense pair's) ``1/s`` into the producer's mapped rows, ``s`` into the
    consumer's columns; both weights' amaxes retaken. Returns how many of ``E`` were folded."""
    folded = [e for e, c in enumerate(pair.choice) if candidates[c] != (0.0, False)]
    if not folded:
        return 0
    mapped, inverse = pair.mapped, pair.inverse
    s = torch.ones(pair.mean.shape, dtype=torch.float32)
    for e in folded:
        s[e] = pair.scales(candidates[pair.choice[e]])[e]
    if pair.experts:
        p, c = getattr(pair.p_module, GATE_UP), getattr(pair.c_module, DOWN)
        rows = torch.ones(p.shape[:-1], dtype=torch.float32)
        rows[:, mapped] = s
        p.copy_((p.float() / rows.to(p.device).unsqueeze(-1)).to(p.dtype))
        c.copy_((c.float() * s[:, inverse].to(c.device).unsqueeze(1)).to(c.dtype))
        for param, t in ((GATE_UP, p), (DOWN, c)):
            q = pair.p_module.quant.weight[param]
            q.reset()
            q.observe(t, reduce_dims=(1, 2))
        return len(folded)
    p, c = pair.p_module.weight, pair.c_module.weight
    rows = torch.ones(p.shape[0], dtype=torch.float32)
    rows[mapped] = s[0]
    p.copy_((p.float() / rows.to(p.device).unsqueeze(-1)).to(p.dtype))
    c.copy_((c.float() * s[0, inverse].to(c.device)).to(c.dtype))
    for lin in (pair.p_module, pair.c_module):
        lin.weight_quantizer.reset()
        lin.weight_quantizer.observe(lin.weight)
    return 1
