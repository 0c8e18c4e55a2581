"""``awq``: activation-aware smoothing of each group of NVFP4 weights that read one normalised input, FOLDED into
the model (no ``pre_quant_scale``: every engine serves it), then the weights' scales by ``max`` or ``gptq``.

ModelOpt's ``awq_lite`` and llm-compressor's ``AWQModifier`` search, per group of Linears that read one input, a
per-input-channel scale ``s = mean|x|^alpha`` (normalised; numerics/awq.py) on a grid of ``alpha`` in [0, 1], the
one whose fake-quantized group output errs least on the calibration tokens. ModelOpt exports ``s`` as a
``pre_quant_scale`` tensor (vLLM does not load it); here, as llm-compressor does, ``1/s`` goes into the weight of
the normalisation that produces the input and ``s`` into every weight that reads it:

- the groups are found from the model's own forward, not named: a *norm* is a module with one 1-D ``weight`` whose
  output doubles exactly when its weight doubles (RMSNorm; not Gemma's ``1 + weight``, not LayerNorm with a bias),
  its *readers* are the modules with parameters whose input is that very output (same storage, same view). Readers
  are NVFP4 Linears and fused routed experts (the group: q/k/v, MLA's q_a/kv_a, gate/up, a MoE layer's experts,
  shared experts), and modules that read the input only through ``weight @ x`` (checked: ``2x`` with ``weight / 2``
  gives the same output) and are left unquantized, such as the router: its weight takes ``s`` too and stays BF16.
- a MoE layer's routed experts share ONE ``s`` with everything else that reads the layer's input; the loss sums the
  output error of every expert's gate/up on the tokens routed to it, on the expert's owner (``owner_inputs``), and
  of every dense member on every rank's tokens; the loss sums and the ``mean|x|`` sums are reduced over ranks (the
  latter exactly: numerics/awq.py), so EP 2 chooses one process's ``alpha`` and folds one process's bits.
- not smoothed (said in the labels, the log and ``smoothing``): a group with an MXFP4-sourced or packed experts
  reader (the lossless cast must stay the source's bytes), a block-FP8 pass-through or non-NVFP4 quantized reader,
  an FSDP2-sharded weight, a reader that takes only part of the output or cannot take the scales, a norm that is
  not a plain scale or is not a source tensor the export can rewrite. ``alpha = 0`` (no smoothing beat none) folds
  nothing.
- the down_proj and o_proj inputs (after the activation, after attention) read no norm: their scales go into the
  producer's output rows (up's, v's), the pairs found by probing the forward (``awq_folds.py``). ``fold_up_down``
  (on; off in the ``awq_gptq`` presets) folds up -> down, one ``s`` per dense MLP and PER ROUTED EXPERT;
  ``fold_v_o`` (off) folds v -> o: it raised layer 0's held-out error on the outlier stand-in
  (docs/decisions/0030-awq-v-o-up-down-folds.md). Their producers and consumers are quantized weights the export
  writes from the model, so nothing is added to ``rewritten``.

The loss is weight-only (inputs unquantized, weights fake-quantized with the group's shared per-tensor scale, as
the export shares it): activation scales are calibrated after the fold, on the smoothed inputs, by ``then`` (its
max) or, with ``inputs: act_headroom`` (the presets), by nvfp4_act_headroom's rule.
The folded norms and router weights are source tensors the export would copy: ``rewritten`` names them, and the
export writes the model's value (in the source dtype) instead. Not built: ``layerwise`` (the layer's norms would
be written before the export knew them).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from ...dist.collectives import run_together
from ...dist.fsdp import is_sharded
from ...dist.group import current_group
from ...experts.dispatch import owner_inputs
from ...experts.packed import is_packed
from ...numerics.awq import (
    MAX_EXACT_TOKENS,
    abs_sum_limbs,
    alpha_grid,
    awq_scales,
    block_normalised_row_sums,
    limbs_to_sum,
)
from ...numerics.constants import NVFP4_BLOCK
from ...numerics.nvfp4 import nvfp4_fake_quant, nvfp4_global_scale
from ...recipe.algorithm import MAX, Algorithm, AlgorithmError
from ..calibrate import share_group_amax
from ..modules import ExpertsQuantState, iter_quantizers, set_mode
from ..schemes import NVFP4_TENSOR
from .act_headroom import (
    HIST_BINS,
    NO_HEADROOM,
    ActHeadroomConfig,
    counting_blocks,
    headroom_inputs,
    refuse_recounted,
    set_headroom_amaxes,
    summed_over_ranks,
)
from .awq_folds import (
    LinearPair,
    PairFinder,
    fold_pair,
    is_nvfp4_linear,
    loss_hooks,
    pair_means,
    pair_plans,
    reduce_losses,
    reduce_pairs,
    routed_tokens,
)
from .base import (
    AlgorithmConfig,
    Calibrator,
    ForwardLoop,
    algorithm_config,
    calibrator_for,
    qformat_presets,
    register_calibrator,
)

log = logging.getLogger(__name__)

THEN = ("max", "gptq")  # the weight algorithms after the fold (each also names a weight_algorithm, below)
INPUTS = ("max", "act_headroom")  # the NVFP4 input scales after ``then``: its max, or nvfp4_act_headroom's rule
GATE_UP = "gate_up_proj"  # the fused experts' projection that reads the layer's input
DOWN = "down_proj"


@dataclass(frozen=True)
class AwqConfig(AlgorithmConfig):
    """``algorithm: {method: awq, alpha_step, duo_scaling, then}``. ``alpha_step``: ModelOpt ``awq_lite``'s grid
    step (0.1: 11 points in [0, 1]). ``duo_scaling``: llm-compressor ``AWQModifier``'s default scale rule (the
    weights' block-relative magnitude divides ``mean|x|^alpha``; numerics/awq.py), searched beside ``s = 1``;
    false: ModelOpt ``awq_lite``'s ``mean|x|^alpha``. ``then``: the weights' scales after the fold, ``max`` or
    ``gptq`` (its ``--qformat nvfp4_gptq`` preset's options): AWQ then GPTQ is the best pair of llm-compressor
    #3001's NVFP4 comparison. ``fold_up_down`` / ``fold_v_o``: also smooth down_proj's input into up's output rows
    (per dense MLP, per routed expert) / o_proj's into v's (``awq_folds.py``); the defaults and the ``awq_gptq``
    preset's ``fold_up_down: false`` are what the peer comparison measured best (decision 0030). ``inputs``:
    the NVFP4 inputs' scales after ``then``, its ``max`` or ``act_headroom`` (nvfp4_act_headroom's rule at its
    defaults, from one more calibration forward of the smoothed model): the presets take the headroom, since a
    channel that smoothing made louder and calibration saw quiet is clipped at max's amax on other tokens."""

    method = "awq"
    weight_algorithms = ("awq", "awq_gptq")
    # duo: it beat the plain rule on the outlier stand-in (benchmarks/results/peer_calibrators.md)
    # awq_gptq without the up -> down fold: it raised that pair's held-out KL (docs/decisions/0030-awq-v-o-up-down-folds.md)
    # inputs by the headroom rule: smoothing clipped other tokens at max's input amax (docs/decisions/0030)
    presets = {"awq": {"duo_scaling": True, "inputs": "act_headroom"},
               "awq_gptq": {"duo_scaling": True, "then": "gptq", "fold_up_down": False, "inputs": "act_headroom"}}

    alpha_step: float = 0.1
    duo_scaling: bool = False
    then: str = "max"
    fold_up_down: bool = True  # also up -> down_proj, dense and per routed expert (awq_folds.py)
    fold_v_o: bool = False  # also v -> o_proj: off, it raised layer 0's held-out error (docs/decisions/0030)
    inputs: str = "max"  # act_headroom: NVFP4 input amaxes by nvfp4_act_headroom's rule (its defaults) after then

    def check(self) -> None:
        if not 0.0 < self.alpha_step <= 1.0:
            raise AlgorithmError(f"algorithm awq: alpha_step must be in (0, 1], got {self.alpha_step}")
        if not isinstance(self.duo_scaling, bool):
            raise AlgorithmError(f"algorithm awq: duo_scaling must be true or false, got {self.duo_scaling!r}")
        for option in ("fold_up_down", "fold_v_o"):
            if not isinstance(getattr(self, option), bool):
                raise AlgorithmError(f"algorithm awq: {option} must be true or false, got {getattr(self, option)!r}")
        if self.then not in THEN:
            raise AlgorithmError(f"algorithm awq: then must be one of {list(THEN)}, got {self.then!r}")
        if self.inputs not in INPUTS:
            raise AlgorithmError(f"algorithm awq: inputs must be one of {list(INPUTS)}, got {self.inputs!r}")

    def candidates(self) -> list[Candidate]:
        """The scale rules searched, in order (the first of equal losses wins): ``alpha`` on the grid, plain; with
        ``duo_scaling`` no smoothing first, then every ``alpha`` duo (llm-compressor's grid with the identity)."""
        alphas = alpha_grid(self.alpha_step)
        if self.duo_scaling:
            return [(0.0, False), *((a, True) for a in alphas)]
        return [(a, False) for a in alphas]

    def then_algorithm(self) -> Algorithm:
        """The algorithm that sets the weights' scales after the fold: max, or the registry's ``nvfp4_<then>``."""
        return MAX if self.then == "max" else qformat_presets()[f"nvfp4_{self.then}"][1]

    def state_bytes(self, out_features: int, in_features: int, dtype_bytes: int) -> tuple[int, int]:
        """The group input's ``|x|`` limb sums (float64 ``[4, in]``; per group, counted per weight: an
        overcount), plus what ``then`` holds."""
        held, kept = algorithm_config(self.then_algorithm()).state_bytes(out_features, in_features, dtype_bytes)
        return held + 32 * in_features, kept


Candidate = tuple[float, bool]  # (alpha, duo): one scale rule of the search


@dataclass(eq=False)
class _Member:
    """One NVFP4 weight of a group: a dense Linear's ``weight`` or a fused experts module's ``gate_up_proj``."""

    name: str  # its weight quantizer's name (the labels' key)
    module: nn.Module
    param: str
    experts: bool


@dataclass(eq=False)
class _Norm:
    """A candidate producer and what pass 1 learned about it."""

    name: str
    module: nn.Module
    scales_exactly: bool | None = None  # doubling its weight doubled its output
    output: torch.Tensor | None = None  # its latest output, held so that no other tensor takes its storage
    readers: dict[str, nn.Module] = field(default_factory=dict)
    partial: set[str] = field(default_factory=set)  # readers that took a different view of the storage
    linear_only: dict[str, bool] = field(default_factory=dict)  # unquantized reader -> takes s through weight only
    limbs: torch.Tensor | None = None
    tokens: int = 0


@dataclass(eq=False)
class _Group:
    """A norm whose output only NVFP4 members and scale-taking modules read: the unit of one search and fold."""

    norm: _Norm
    members: list[_Member]
    others: list[tuple[str, nn.Module]]  # unquantized readers whose weight takes s (the router)
    mean: torch.Tensor | None = None
    weight_mean: torch.Tensor | None = None  # the members' mean block-relative |w| per input channel (duo only)
    losses: torch.Tensor | None = None  # float64 [candidates]
    choice: Candidate | None = None

    def scales(self, candidate: Candidate) -> torch.Tensor:
        alpha, duo = candidate
        return awq_scales(self.mean, alpha, self.weight_mean if duo else None)


def _gathered_experts(local: torch.Tensor, placement) -> torch.Tensor:
    """``[local experts, ...]`` -> ``[num_experts, ...]`` in global expert order: every EP rank's block, gathered
    over the placement's group (the world where it names none); ``local`` itself in one process."""
    if placement.ep_size == 1:
        return local
    g = current_group()
    parts = [torch.empty_like(local, device=g.device) for _ in range(placement.ep_size)]
    dist.all_gather(parts, local.to(g.device), group=placement.group or g.pg)
    return torch.cat([p.cpu() for p in parts])  # EP rank r holds the r-th contiguous block


def _calling_each(hooks: list):
    def hook(*args):
        for h in hooks:
            h(*args)
    return hook


def _first_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    x = args[0] if args else kwargs.get("hidden_states")
    return x if isinstance(x, torch.Tensor) else None


def _norm_candidates(model: nn.Module) -> dict[str, nn.Module]:
    """Modules whose only parameter is a 1-D ``weight`` (RMSNorm-like; the doubling test decides)."""
    out = {}
    for name, m in model.named_modules():
        params = dict(m.named_parameters(recurse=False))
        if set(params) == {"weight"} and params["weight"].dim() == 1:
            out[name] = m
    return out


def _without_containers(readers: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """``readers`` less the modules that pass the input on to readers of their own (GPT-OSS's attention, whose
    own parameter, the sinks, never meets it) and hold no 2-D ``weight`` that could read it themselves."""
    def container(name: str, m: nn.Module) -> bool:
        w = getattr(m, "weight", None)
        own = isinstance(w, nn.Parameter) and w.dim() == 2
        return not own and any(other.startswith(f"{name}.") for other in readers)

    return {name: m for name, m in readers.items() if not container(name, m)}


def _same_output(a: object, b: object) -> bool:
    xs, ys = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(xs) == len(ys) and all(
        (torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y)
        for x, y in zip(xs, ys))


@contextmanager
def _scaled_param(p: torch.Tensor, factor: float) -> Iterator[None]:
    """``p`` times a power of two (exact) for the block, restored exactly."""
    with torch.no_grad():
        p.mul_(factor)
        try:
            yield
        finally:
            p.mul_(1.0 / factor)


@register_calibrator
class AwqCalibrator(Calibrator):
    config_type = AwqConfig

    def __init__(self, algorithm, config) -> None:
        super().__init__(algorithm, config)
        # norm name -> (the alpha folded, or None) and what it says: the members smoothed, or why not
        self.smoothing: dict[str, tuple[float | None, str]] = {}

    # ------------------------------------------------------------------ pass 1: groups and mean|x|

    def _observe(self, model: nn.Module, forward_loop: ForwardLoop, finder: PairFinder | None) -> dict[str, _Norm]:
        """Pass 1: the norms, their readers and ``mean|x|`` limbs; with ``finder``, the v->o / up->down pairs and
        their consumers' limbs too (no hook counts the finder's re-runs)."""
        norms = {name: _Norm(name, m) for name, m in _norm_candidates(model).items()}
        probing = (lambda: finder.probing) if finder is not None else (lambda: False)
        by_storage: dict[int, _Norm] = {}
        handles = []

        def produced(n: _Norm):
            def hook(mod, args, kwargs, out):
                if not isinstance(out, torch.Tensor) or probing():
                    return
                if n.scales_exactly is None:  # once: is the output the weight times a function of the input?
                    with _scaled_param(mod.weight, 2.0):
                        doubled = mod.forward(*args, **kwargs)
                    n.scales_exactly = isinstance(doubled, torch.Tensor) and torch.equal(doubled, out * 2)
                if n.output is not None:
                    by_storage.pop(n.output.untyped_storage().data_ptr(), None)
                n.output = out
                by_storage[out.untyped_storage().data_ptr()] = n
                limbs = abs_sum_limbs(out)
                n.limbs = limbs if n.limbs is None else n.limbs + limbs.to(n.limbs.device)
                n.tokens += out.numel() // out.shape[-1]
            return hook

        def read(name: str):
            def hook(mod, args, kwargs):
                x = _first_input(args, kwargs)
                if x is None or probing():
                    return
                n = by_storage.get(x.untyped_storage().data_ptr())
                if n is None or mod is n.module:
                    return
                n.readers[name] = mod
                if x.storage_offset() != n.output.storage_offset() or x.numel() != n.output.numel():
                    n.partial.add(name)
                elif not is_nvfp4_linear(mod) and not isinstance(getattr(mod, "quant", None), ExpertsQuantState) \
                        and name not in n.linear_only:
                    n.linear_only[name] = self._takes_scale_through_weight(mod, args, kwargs, x)
            return hook

        for n in norms.values():
            handles.append(n.module.register_forward_hook(produced(n), with_kwargs=True))
        for name, m in model.named_modules():
            if name in norms or not (any(True for _ in m.parameters(recurse=False)) or
                                     isinstance(getattr(m, "quant", None), ExpertsQuantState)):
                continue
            handles.append(m.register_forward_pre_hook(read(name), with_kwargs=True, prepend=True))
        set_mode(model, "off")
        try:
            with ExitStack() as stack:
                if finder is not None:
                    finder.hooks(stack)
                run_together("awq statistics forward", forward_loop, model)
        finally:
            for h in handles:
                h.remove()
            for n in norms.values():
                n.output = None
        return norms

    @staticmethod
    def _takes_scale_through_weight(mod: nn.Module, args: tuple, kwargs: dict, x: torch.Tensor) -> bool:
        """Whether ``mod`` reads ``x`` only through its 2-D ``weight``'s last dim: the output with ``2 x`` and
        ``weight / 2`` is the output (powers of two: exact)."""
        w = getattr(mod, "weight", None)
        if not isinstance(w, nn.Parameter) or w.dim() != 2 or w.shape[-1] != x.shape[-1]:
            return False
        rest = args[1:] if args else ()
        kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        ref = mod.forward(x, *rest, **kw)
        with _scaled_param(w, 0.5):
            scaled = mod.forward(x * 2, *rest, **kw)
        return _same_output(ref, scaled)

    # ------------------------------------------------------------------ which groups are smoothed

    def _groups(self, model: nn.Module, norms: dict[str, _Norm]) -> list[_Group]:
        with self.load.source() as reader:
            stored = set(reader.names())
        groups = []
        for n in norms.values():
            if not n.readers:
                continue
            members, others, why = [], [], []
            quantized = []  # every quantized reader's weight quantizer name: the labels say why it was not smoothed
            for name, m in _without_containers(n.readers).items():
                state = getattr(m, "quant", None)
                if isinstance(state, ExpertsQuantState) and GATE_UP in state.weight:
                    quantized.append(f"{name}.{GATE_UP}")
                elif getattr(m, "weight_quantizer", None) is not None:
                    quantized.append(name)
                if name in n.partial:
                    why.append(f"{name} reads only part of its output")
                elif is_nvfp4_linear(m):
                    members.append(_Member(name, m, "weight", False))
                    if is_sharded(m.weight):
                        why.append(f"{name} is FSDP2-sharded (the fold needs whole weights)")
                elif isinstance(state, ExpertsQuantState):
                    q = state.weight[GATE_UP] if GATE_UP in state.weight else None
                    if q is None or q.fmt is not NVFP4_TENSOR:
                        why.append(f"{name}'s {GATE_UP} is not NVFP4")
                    elif q.source is not None:
                        why.append(f"{name} is MXFP4-sourced (the lossless cast keeps the source's bytes)")
                    elif is_packed(m) or is_sharded(getattr(m, GATE_UP)):
                        why.append(f"{name} is packed-resident or sharded (the fold needs its decoded weights)")
                    else:
                        members.append(_Member(f"{name}.{GATE_UP}", m, GATE_UP, True))
                elif getattr(m, "weight_quantizer", None) is not None:
                    why.append(f"{name} is quantized as {m.weight_quantizer.fmt} or from source bytes (not built)")
                elif n.linear_only.get(name):
                    if f"{name}.weight" not in stored:
                        why.append(f"{name}.weight is no source tensor the export can rewrite")
                    others.append((name, m))
                else:
                    why.append(f"{name} ({type(m).__name__}) cannot take the scales")
            if not members and not why:
                continue  # nothing quantized reads it (the final norm before a BF16 lm_head)
            if not n.scales_exactly:
                why.append(f"its output is not its weight times a function of its input ({type(n.module).__name__})")
            elif f"{n.name}.weight" not in stored:
                why.append(f"{n.name}.weight is no source tensor the export can rewrite")
            if why:
                self.smoothing[n.name] = (None, "not smoothed: " + "; ".join(why))
                for name in quantized:
                    self.labels[name] = f"not smoothed by awq: {why[0]}"
                continue
            groups.append(_Group(n, members, others))
        return groups

    def _reduce_means(self, groups: list[_Group]) -> None:
        """``mean|x|`` of each group's input over every rank's tokens (integer-valued limbs: exact)."""
        g = current_group()
        if not groups:
            return
        buf = torch.cat([torch.cat([gr.norm.limbs.cpu().reshape(-1), torch.tensor([float(gr.norm.tokens)],
                                                                                   dtype=torch.float64)])
                         for gr in groups])
        if g.world_size > 1:
            buf = buf.to(g.device)
            dist.all_reduce(buf, group=g.pg)
            buf = buf.cpu()
        pos = 0
        for gr in groups:
            size = gr.norm.limbs.numel()
            limbs = buf[pos:pos + size].reshape(gr.norm.limbs.shape)
            tokens = int(buf[pos + size])
            pos += size + 1
            if tokens > MAX_EXACT_TOKENS:
                raise ValueError(f"awq: {tokens} calibration tokens reached {gr.norm.name}; its exact mean holds up "
                                 f"to {MAX_EXACT_TOKENS}: calibrate on fewer tokens")
            gr.mean = limbs_to_sum(limbs) / tokens

    def _weight_means(self, groups: list[_Group]) -> None:
        """Each group's ``mean|w~|`` (duo scaling): block-relative row sums of its dense members (whole on every
        rank) plus its routed experts', gathered over the EP group in global expert order and summed in that
        order, so every rank and one process add the same numbers in the same order."""
        placement = self.load.placement.experts
        for gr in groups:
            total, rows = None, 0
            for mem in gr.members:
                w = getattr(mem.module, mem.param).detach()
                sums = block_normalised_row_sums(w, NVFP4_BLOCK)
                if mem.experts:
                    sums, experts = _gathered_experts(sums.cpu(), placement), placement.num_experts
                    sums = sums.sum(dim=0)
                    rows += experts * w.shape[-2]
                else:
                    rows += w.shape[-2]
                sums = sums.cpu()
                total = sums if total is None else total + sums
            gr.weight_mean = total / rows

    # ------------------------------------------------------------------ pass 2: the loss of each alpha

    def _losses(self, model: nn.Module, forward_loop: ForwardLoop, groups: list[_Group],
                candidates: list[Candidate], pairs: list[LinearPair]) -> None:
        """For every group (and v->o / up->down pair) and candidate scale rule, the summed squared output error of
        its members' fake-quantized smoothed weights against their weights, on the calibration tokens (dense: this
        rank's; experts: those routed to the experts this rank owns), then summed over ranks (routed pairs: their
        owner's alone)."""
        for gr in groups:
            gr.losses = torch.zeros(len(candidates), dtype=torch.float64)
        plans = [self._candidate_plans(gr, candidates) for gr in groups]

        def dense(gr: _Group, plan, mem: _Member):
            def hook(mod, args, kwargs):
                x = _first_input(args, kwargs)
                if x is not None and x.numel():
                    gr.losses += self._member_losses(mem.module.weight, x, plan, mem)
            return hook

        def routed(gr: _Group, plan, mem: _Member):
            def hook(module, hidden, local_ids):
                if hidden.shape[0] == 0:
                    return
                tokens = routed_tokens(module, hidden, local_ids)
                gr.losses += self._experts_losses(getattr(module, GATE_UP), tokens, plan, mem)
            return hook

        handles = []
        owner_hooks: dict[nn.Module, list] = {}  # one owner hook per experts module, calling each of these
        set_mode(model, "off")
        try:
            with torch.no_grad(), ExitStack() as observing:
                for gr, plan in zip(groups, plans):
                    for mem in gr.members:
                        if mem.experts:
                            owner_hooks.setdefault(mem.module, []).append(routed(gr, plan, mem))
                        else:
                            handles.append(mem.module.register_forward_pre_hook(dense(gr, plan, mem),
                                                                                with_kwargs=True))
                for pair in pairs:
                    loss_hooks(pair, pair_plans(pair, candidates), observing, owner_hooks)
                for module, hooks in owner_hooks.items():
                    observing.enter_context(owner_inputs(module, _calling_each(hooks)))
                run_together("awq search forward", forward_loop, model)
        finally:
            for h in handles:
                h.remove()
        g = current_group()
        if g.world_size > 1 and groups:
            buf = torch.stack([gr.losses for gr in groups]).to(g.device)
            dist.all_reduce(buf, group=g.pg)
            for gr, row in zip(groups, buf.cpu()):
                gr.losses = row
        reduce_losses(pairs)

    @staticmethod
    def _candidate_plans(gr: _Group, candidates: list[Candidate]) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]]]:
        """Per candidate: the scales ``s`` and each member's NVFP4 global scale of its smoothed weight: the group's
        dense members share one (max of their amaxes, as the export shares ``weight_scale_2``), each routed
        expert its own (``[E]``, gate and up together)."""
        plans = []
        dense = [m for m in gr.members if not m.experts]
        for c in candidates:
            s = gr.scales(c)
            scales: dict[int, torch.Tensor] = {}
            if dense:
                amax = torch.stack([(m.module.weight.detach().float() * s.to(m.module.weight.device)).abs().amax()
                                    for m in dense]).amax()
                for m in dense:
                    scales[id(m)] = nvfp4_global_scale(amax)
            for m in gr.members:
                if m.experts:
                    w = getattr(m.module, GATE_UP).detach()
                    scales[id(m)] = nvfp4_global_scale((w.float() * s.to(w.device)).abs().amax(dim=(1, 2)))
            plans.append((s, scales))
        return plans

    @staticmethod
    def _member_losses(weight: torch.Tensor, x: torch.Tensor, plan, mem: _Member) -> torch.Tensor:
        """``[alphas]`` float64: ``|| fq(W diag(s)) (x / s) - W x ||²`` summed over ``x``'s tokens."""
        w = weight.detach().float()
        x = x.detach().reshape(-1, x.shape[-1]).float().to(w.device)
        ref = x @ w.T
        out = torch.empty(len(plan), dtype=torch.float64)
        for i, (s, scales) in enumerate(plan):
            s = s.to(w.device)
            wq = nvfp4_fake_quant(w * s, scales[id(mem)].to(w.device))
            out[i] = ((x / s) @ wq.T - ref).double().pow(2).sum().cpu()
        return out

    @staticmethod
    def _experts_losses(weight: torch.Tensor, tokens: dict[int, torch.Tensor], plan, mem: _Member) -> torch.Tensor:
        """``_member_losses`` summed over the local experts ``tokens`` names (local id -> its routed tokens), each
        alpha's smoothed weights fake-quantized for all of them at once (each expert with its own global scale)."""
        out = torch.zeros(len(plan), dtype=torch.float64)
        if not tokens:
            return out
        w = weight.detach().float()
        xs = {e: x.detach().reshape(-1, x.shape[-1]).float().to(w.device) for e, x in tokens.items()}
        refs = {e: x @ w[e].T for e, x in xs.items()}
        for i, (s, scales) in enumerate(plan):
            s = s.to(w.device)
            wq = nvfp4_fake_quant(w * s, scales[id(mem)].to(w.device).view(-1, 1, 1))
            total = torch.zeros((), dtype=torch.float64, device=w.device)
            for e, x in xs.items():  # in ascending expert order: the same order on any rank that owns them
                total += ((x / s) @ wq[e].T - refs[e]).double().pow(2).sum()
            out[i] = total.cpu()
        return out

    # ------------------------------------------------------------------ the fold

    @torch.no_grad()
    def _fold(self, gr: _Group, s: torch.Tensor) -> None:
        """``1/s`` into the norm's weight, ``s`` into each reader's input columns; weight amaxes retaken."""
        w = gr.norm.module.weight
        w.copy_((w.float() / s.to(w.device)).to(w.dtype))
        self.rewritten.add(f"{gr.norm.name}.weight")
        for mem in gr.members:
            p = getattr(mem.module, mem.param)
            p.copy_((p.float() * s.to(p.device)).to(p.dtype))
            q = mem.module.quant.weight[GATE_UP] if mem.experts else mem.module.weight_quantizer
            q.reset()
            q.observe(p, reduce_dims=(1, 2) if mem.experts else None)
        for name, m in gr.others:
            m.weight.copy_((m.weight.float() * s.to(m.weight.device)).to(m.weight.dtype))
            self.rewritten.add(f"{name}.weight")

    # ------------------------------------------------------------------ the run

    def calibrate(self, model: nn.Module, forward_loop: ForwardLoop | None,
                  groups: dict[str, tuple[str, ...]]) -> None:
        if forward_loop is None:
            raise ValueError("algorithm awq needs calibration data (a forward_loop)")
        if self.load is None:  # a part of the model (a layerwise layer) or a bare module
            raise ValueError("algorithm awq under layerwise is not built (the folded norms of a layer would be "
                             "written before the export knew them): calibrate resident")
        if self.config.inputs == "act_headroom":
            refuse_recounted(model, "algorithm awq (inputs: act_headroom)")
        candidates = self.config.candidates()
        folds = (self.config.fold_v_o, self.config.fold_up_down)
        finder = PairFinder(model, *folds) if any(folds) else None
        found = self._groups(model, self._observe(model, forward_loop, finder))
        pairs = self._pairs(finder)
        self._reduce_means(found)
        reduce_pairs(pairs)
        if self.config.duo_scaling:
            self._weight_means(found)
        for pair in pairs:
            pair_means(pair, self.config.duo_scaling)
        self._losses(model, forward_loop, found, candidates, pairs)
        chosen: dict[str, list[str]] = {}  # weight -> the folds that changed it
        for gr in found:
            best = int(torch.argmin(gr.losses))  # the first of equal losses: no smoothing, then the smaller alpha
            gr.choice = candidates[best]
            alpha, duo = gr.choice
            members = ", ".join(m.name for m in gr.members)
            if gr.choice == (0.0, False):
                self.smoothing[gr.norm.name] = (None, f"not smoothed: alpha 0 erred least ({members})")
                for m in gr.members:
                    self.labels[m.name] = "not smoothed by awq: alpha 0 erred least"
                continue
            self._fold(gr, gr.scales(gr.choice))
            gain = float(gr.losses[best] / gr.losses[0]) if gr.losses[0] > 0 else 1.0
            rule = f"alpha {alpha:g}" + (" duo" if duo else "")
            self.smoothing[gr.norm.name] = (alpha, f"smoothed: {rule}, search loss x{gain:.3f} of "
                                                   f"no smoothing, into {members}" +
                                            "".join(f" and {n} (BF16)" for n, _ in gr.others))
            for m in gr.members:
                chosen.setdefault(m.name, []).append("smoothing folded into its input's norm")
        self._fold_pairs(model, pairs, candidates, chosen)
        if current_group().is_main:
            for norm, (_, what) in self.smoothing.items():
                log.info("awq %s: %s", norm, what)
        then = calibrator_for(self.config.then_algorithm())
        then.load = self.load
        then.calibrate(model, forward_loop, groups)
        self._merge(then, chosen)
        if self.config.inputs == "act_headroom":
            self._input_headroom(model, forward_loop, groups)

    def _input_headroom(self, model: nn.Module, forward_loop: ForwardLoop,
                        groups: dict[str, tuple[str, ...]]) -> None:
        """Every NVFP4 input's amax by nvfp4_act_headroom's rule, from the block-amax histogram of one more
        calibration forward of the smoothed model (calibration mode, as that calibrator counts: every expert
        sees every token where the recipe says so) and ``then``'s max as the observed max; shared-input groups
        then take their members' max again. Smoothing moves each channel by its ``1/s``: a channel quiet in
        calibration and loud later is what max's amax clips and the headroom holds (decision 0030)."""
        inputs = headroom_inputs(model)
        calibrated = {name: q.amax.clone() for name, q in inputs.items()}
        counting = {name: q.stats for name, q in inputs.items()}  # the report's calibration counts: one pass only
        modes = [(q, q.mode) for _, q in iter_quantizers(model)]
        counts = {name: torch.zeros(HIST_BINS, dtype=torch.int64) for name in inputs}
        handles = counting_blocks(inputs, counts, "calib")
        set_mode(model, "off")  # the unquantized smoothed model, as max's calibration forward saw it
        try:
            for q in inputs.values():
                q.stats, q.mode = None, "calib"
            with torch.no_grad():
                run_together("awq input headroom forward", forward_loop, model)
        finally:
            for h in handles:
                h.remove()
            for name, q in inputs.items():
                q.stats = counting[name]
                q.amax.copy_(calibrated[name])  # the observed max stays then's (max-reduced over ranks)
            for q, mode in modes:
                q.mode = mode
        kept = set_headroom_amaxes(inputs, summed_over_ranks(counts), ActHeadroomConfig())
        share_group_amax(model, groups)
        for name, which in kept.items():  # as nvfp4_act_headroom labels them: the inputs the rule left at max
            self.labels[name] = f"nvfp4_act_headroom after awq ({NO_HEADROOM[which]})"
        if current_group().is_main:
            log.info("awq inputs: %d NVFP4 input scales by nvfp4_act_headroom's rule (%d left at max)",
                     len(inputs) - len(kept), len(kept))

    def _pairs(self, finder: PairFinder | None) -> list[LinearPair]:
        """The v->o / up->down pairs found (by name: the same order on every rank); the skipped ones said in
        ``smoothing`` and their consumers' labels."""
        if finder is None:
            return []
        for key, why in sorted(finder.skipped.items()):
            self.smoothing[key] = (None, f"not folded: {why}")
            for name in finder.quantized_consumers.get(key, []):
                self.labels[name] = f"not smoothed by awq: {why}"
        return [p for _, p in sorted(finder.pairs.items())]

    def _fold_pairs(self, model: nn.Module, pairs: list[LinearPair], candidates: list[Candidate],
                    chosen: dict[str, list[str]]) -> None:
        """Each pair's (each expert's) best candidate folded; what was folded said in ``smoothing`` and, through
        ``chosen``, the labels (a routed pair's count of folded experts summed over the EP group)."""
        folded = []
        for pair in pairs:
            pair.choice = [int(i) for i in torch.argmin(pair.losses, dim=1)]  # the first of equal losses
            folded.append(fold_pair(pair, candidates))
        routed = [i for i, p in enumerate(pairs) if p.experts]
        placement = self.load.placement.experts
        if routed and placement.ep_size > 1:
            counts = torch.tensor([folded[i] for i in routed], dtype=torch.float64).to(current_group().device)
            dist.all_reduce(counts, group=placement.group or current_group().pg)
            for i, n in zip(routed, counts.cpu().tolist()):
                folded[i] = int(n)
        for pair, n in zip(pairs, folded):
            if pair.experts:
                total = placement.num_experts
                alphas = sorted({candidates[c][0] for c in pair.choice if candidates[c] != (0.0, False)})
                self.smoothing[pair.name] = (None, f"folded per expert into {n} of {total} experts" +
                                             (f" (this rank's alphas {alphas})" if alphas else ""))
                if n:
                    chosen.setdefault(pair.consumer, []).append(
                        f"per-expert smoothing folded into {GATE_UP}'s rows, {n} of {total} experts")
                    chosen.setdefault(pair.producer, []).append(f"rows scaled for {DOWN}'s smoothing")
                else:
                    self.labels[pair.consumer] = "not smoothed by awq: alpha 0 erred least for every expert"
                continue
            best = pair.choice[0]
            if not n:
                self.smoothing[pair.name] = (None, "not folded: alpha 0 erred least")
                self.labels.setdefault(pair.consumer, "not smoothed by awq: alpha 0 erred least")
                continue
            alpha, duo = candidates[best]
            gain = float(pair.losses[0, best] / pair.losses[0, 0]) if pair.losses[0, 0] > 0 else 1.0
            self.smoothing[pair.name] = (alpha, f"folded: alpha {alpha:g}" + (" duo" if duo else "") +
                                         f", search loss x{gain:.3f} of no smoothing")
            chosen.setdefault(pair.consumer, []).append(f"smoothing folded into {pair.producer}'s output rows")
            chosen.setdefault(pair.producer, []).append(f"output rows scaled for {pair.consumer}'s smoothing")

    def _merge(self, then: Calibrator, chosen: dict[str, list[str]]) -> None:
        """``then``'s labels and weight algorithms, the smoothed weights' named ``awq``/``awq_gptq``."""
        notes = dict(self.labels)  # the groups not smoothed, by why
        self.labels = dict(then.labels)
        self.weight_algorithms = dict(then.weight_algorithms)
        for name, note in notes.items():
            if name not in chosen:
                self.labels[name] = f"{then.labels.get(name, 'max')} ({note})"
        for name, folds in chosen.items():
            after = then.weight_algorithms.get(name, "max")
            # the alphas are in ``smoothing`` and the log: one summary line per ``then`` label, not per group
            what = "; ".join([*folds, *([notes[name]] if name in notes else [])])
            self.labels[name] = f"awq ({what}), then {then.labels.get(name, 'max')}"
            if after in ("max", "gptq"):
                self.weight_algorithms[name] = "awq" if after == "max" else "awq_gptq"
