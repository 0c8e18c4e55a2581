"""``gptq``: max, then every NVFP4 weight's values updated by GPTQ under max's fixed scales
(numerics/gptq.py; ModelOpt 0.47 ``gptq``): dense Linears and routed experts, each expert by its owner.

Hessians ``2/n * sum x xᵀ`` come from more forwards of the model with activations fake-quantized (each
Linear's input after its own input quantizer, as ModelOpt's ``GPTQHelper`` takes it).

- ModelOpt's semantics (``true_sequential: false``, ModelOpt 0.47 ``model_calib.py`` ``gptq``): one forward
  with every weight quantizer disabled gives every Hessian; all weights are updated after it. Within a layer,
  down_proj's Hessian therefore comes from gate/up outputs of the unquantized weights.
- ``true_sequential: true`` (ours; GPTQ's "true sequential" order): the weights of each scope (a decoder
  layer, or the module a layerwise run hands over) are updated in stages, a stage being the Linears that read
  one input tensor (q/k/v; o; gate/up; down; routed experts' gate/up, then their down). Pass ``k`` takes the
  Hessians of every scope's stage ``k`` with the weights of stages ``< k`` quantized (their GPTQ values) and
  the rest unquantized, so down_proj's Hessian comes from the quantized gate/up output. Resident, all
  decoder layers advance together (pass ``k`` quantizes stages ``< k`` of every layer; as many passes as a
  layer has stages); under ``modelopt_k3.layerwise`` each layer does so alone, on inputs from the quantized
  layers before it. Stages are found in the first pass: the order of first calls and the identity of the
  tensor each Linear receives (model-agnostic).

Dense Hessians are summed over ranks (``moments.reduce_moments``: exact integer-valued float64 sums). Routed
experts: each expert's Hessian is accumulated by its owner from the (token, slot) pairs routed to it, as they
reach it (``experts.dispatch.owner_inputs``: after ``torch_a2a``'s exchange), nothing per expert travels; the
down projection's input is recomputed there from those tokens (gate/up in effect, the model's activation, the
down input quantizer); replicated expert groups add up their replicas' sums. A projection's local experts are
then solved together (``nvfp4_gptq_batched``, bit for bit the per-expert loop's; decision 0008). Skipped, keeping max:
MXFP4-sourced experts (the lossless cast), packed-resident experts.
The updated weight lives in the quantizer (``updated_weight``): fake quant and export use it, the module keeps
the original (the report's and the KL evaluation's reference).
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...dist.collectives import run_together
from ...dist.fsdp import is_sharded
from ...experts.dispatch import owner_inputs
from ...numerics.gptq import asymmetric_target, gptq_batch_bytes, nvfp4_gptq, nvfp4_gptq_batched
from ...numerics.nvfp4 import nvfp4_block_scales
from ...recipe.algorithm import AlgorithmError
from ..modules import set_mode
from ..quantizer import TensorQuantizer
from ..schemes import NVFP4_TENSOR
from .base import AlgorithmConfig, ForwardLoop, register_calibrator
from .max import MaxCalibrator
from .moments import (
    EXPERT_PARAMS,
    Accumulator,
    ExpertSums,
    expert_observer,
    input_amax,
    nvfp4_linears,
    owner_observes,
    reduce_moments,
)
from .weights import SKIPPED_MXFP4, weight_sites

# Working memory one batched expert solve may take (bytes): within the planner's device runtime allowance
# (memory/planner.py DEVICE_RUNTIME_BYTES), enough to batch the 64 experts of the tiny models' MoE layers.
BATCH_BYTES = 2**30


class _Cross(Accumulator):
    """``sum x yᵀ`` of paired inputs (``x`` the reference, ``y`` the Linear's own), rank-independent as
    ``Accumulator`` is: both split on the Linear's input-amax grid, the integer-valued products summed in float64."""

    def __init__(self, amax: float) -> None:
        super().__init__(False, amax)

    def add_pair(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
        y = y.detach().reshape(-1, y.shape[-1]).to(torch.float64)
        if x.shape != y.shape:
            raise RuntimeError(f"gptq: a reference input {tuple(x.shape)} does not pair with the input {tuple(y.shape)}")
        hx, hy = torch.round(x / self.g1), torch.round(y / self.g1)
        lx, ly = torch.round((x - hx * self.g1) / self.g2), torch.round((y - hy * self.g1) / self.g2)
        hh, hl = hx.T @ hy, hx.T @ ly + lx.T @ hy
        self.hh = hh if self.hh is None else self.hh + hh
        self.hl = hl if self.hl is None else self.hl + hl
        self.tokens += x.shape[0]

    def combine(self, hh: torch.Tensor, hl: torch.Tensor) -> torch.Tensor:
        return hh * (self.g1 * self.g1) + hl * (self.g1 * self.g2)


@dataclass(eq=False)
class _Target:
    """One weight GPTQ updates: a dense Linear (``param`` None) or one fused projection of an experts module."""

    name: str
    module: nn.Module
    param: str | None
    quantizer: TensorQuantizer
    stage: int | None = None
    dense: Accumulator | None = None
    experts: ExpertSums | None = None  # routed experts: each local expert's Hessian sums, on its owner
    reduced: tuple[torch.Tensor, int] | None = None  # dense: the sums over every rank, and the token count
    stash: list[torch.Tensor] = field(default_factory=list)  # asymmetric: the reference inputs, call by call
    cross: _Cross | None = None  # asymmetric: sum of (reference input) x (input)ᵀ
    cross_reduced: torch.Tensor | None = None


def _decoder_layers(model: nn.Module, load) -> dict[str, nn.Module]:
    """The decoder layers by name (the whole loaded model: ``load``, the run's, names them); else none (the
    module calibrated, a layerwise layer or a bare module, is one scope)."""
    return {} if load is None else dict(load.spec.decoder_layers(model))


class _Stages:
    """Stage of every target within its scope, from the first calls' order and input identity.

    A target is numbered at its first call (before its sums are taken): 0 if it opens its scope's first
    event, pending (-1) otherwise; ``assign`` numbers the rest once the forward is over."""

    def __init__(self, scopes: list[str]) -> None:
        self.scopes = scopes
        self.count = 0
        self.last: object | None = None
        self.event: dict[int, int] = {}  # id(target) -> global event number
        self.first: dict[str, int] = {}  # scope -> its first event

    def scope(self, name: str) -> str:
        return next((p for p in self.scopes if name.startswith(p)), "")

    def seen(self, target: _Target, x: object) -> None:
        if id(target) in self.event:
            return
        if x is None or x is not self.last:
            self.count += 1
            self.last = x
        self.event[id(target)] = self.count
        first = self.first.setdefault(self.scope(target.name), self.count)
        target.stage = 0 if self.count == first else -1

    def assign(self, targets: list[_Target]) -> int:
        """Number each scope's events 0, 1, ...; returns the most stages a scope has."""
        by_scope: dict[str, list[_Target]] = {}
        for t in targets:
            if id(t) in self.event:
                by_scope.setdefault(self.scope(t.name), []).append(t)
        most = 0
        for members in by_scope.values():
            rank = {e: i for i, e in enumerate(sorted({self.event[id(t)] for t in members}))}
            for t in members:
                t.stage = rank[self.event[id(t)]]
            most = max(most, len(rank))
        return most


@dataclass(frozen=True)
class GptqConfig(AlgorithmConfig):
    """``algorithm: {method: gptq, ...}``: ModelOpt 0.47's ``GPTQCalibConfig`` defaults, plus two options of ours.
    The only algorithm whose layerwise default feeds each layer quantized inputs (ModelOpt's too)."""

    method = "gptq"
    weight_algorithms = ("gptq",)
    qdq_inputs_by_default = True
    # general/ptq/nvfp4_default-kv_none-gptq (damp 0.01, block 128), with true_sequential and asymmetric
    presets = {"gptq": {"perc_damp": 0.01, "block_size": 128, "true_sequential": True, "asymmetric": True}}

    perc_damp: float = 0.01
    block_size: int = 128
    # Ours, not ModelOpt's (default False: its one Hessian forward): update each layer's weights in stages,
    # later stages' Hessians from the earlier stages' quantized outputs.
    true_sequential: bool = False
    # Ours too (needs true_sequential): a later stage's GPTQ aims at the unquantized model's output of the
    # Linear, ||W X - Ŵ X̃||, not at ||W X̃ - Ŵ X̃|| (X̃: its inputs with the earlier stages quantized).
    asymmetric: bool = False

    def check(self) -> None:
        if self.block_size <= 0 or self.block_size % 16:
            raise AlgorithmError(f"algorithm gptq: block_size must be a positive multiple of 16, got {self.block_size}")
        if self.asymmetric and not self.true_sequential:
            raise AlgorithmError("algorithm gptq: asymmetric needs true_sequential (its reference is the earlier "
                                 "stages unquantized)")

    def state_bytes(self, out_features: int, in_features: int, dtype_bytes: int) -> tuple[int, int]:
        """Float64 hi/lo sums ``2 x [in, in]`` (every weight at once: exact for ModelOpt's one pass;
        ``true_sequential`` holds one stage at a time, so this overcounts it), and the updated weight (a copy in
        the run's dtype) with its block scales, kept until the export."""
        return 16 * in_features * in_features, out_features * in_features * dtype_bytes + out_features * in_features // 16


@register_calibrator
class GptqCalibrator(MaxCalibrator):
    config_type = GptqConfig

    def __init__(self, algorithm, config) -> None:
        super().__init__(algorithm, config)
        self.passes = 0  # Hessian forwards run (after max's)

    # ------------------------------------------------------------------ what gets updated

    def _targets(self, model: nn.Module) -> list[_Target]:
        targets = [_Target(n, m, None, m.weight_quantizer) for n, m in model.named_modules()
                   if id(m) in nvfp4_linears(model)]
        for site in weight_sites(model):
            if not site.experts:
                continue
            q, m = site.quantizer, site.module
            if q.source is not None:
                self.labels[site.name] = SKIPPED_MXFP4
            elif q.fmt is not NVFP4_TENSOR:
                self.labels[site.name] = "max (not NVFP4)"
            elif not owner_observes(m, site.param):
                self.labels[site.name] = "max (gptq of these routed experts not built: packed or unknown layout)"
            elif is_sharded(getattr(m, site.param)):
                self.labels[site.name] = "max (gptq of FSDP2-sharded routed experts not built: it needs whole experts)"
            else:
                targets.append(_Target(site.name, m, site.param, q, experts=ExpertSums(m.quant, site.param, False)))
        return targets

    # ------------------------------------------------------------------ the Hessian forwards

    def _collect(self, model: nn.Module, forward_loop: ForwardLoop, targets: list[_Target], stage: int | None,
                 stages: _Stages | None, *, reference: bool = False, paired: bool = False,
                 layers: dict[str, nn.Module] | None = None) -> None:
        """One forward; sums for the targets of ``stage`` (None: all). ``stages``: find the stages on the way.

        ``paired``: each call's input also paired with its reference (``_Cross``): with ``layers`` (resident),
        every decoder layer first reruns on the same arguments with its own weights unquantized, keeping the
        stage's inputs of that call; without, the reference is the previous forward's (``reference``: every
        weight unquantized, each wanted dense target's inputs kept on the host, call by call)."""
        rerunning = [False]  # inside a decoder layer's reference rerun (``paired`` with ``layers``)

        def collecting(t: _Target) -> bool:
            return (stage is None or t.stage == stage) and not rerunning[0]

        dense = [t for t in targets if t.param is None]
        experts: dict[int, dict[str, _Target]] = {}
        for t in targets:
            if t.param is not None:
                experts.setdefault(id(t.module), {})[t.param] = t
        handles = []
        for t in dense:
            if stages is not None:
                handles.append(t.module.register_forward_pre_hook(
                    lambda mod, args, t=t: stages.seen(t, args[0]), prepend=True))  # raw input: its identity

            def add(mod, args, t=t):
                if rerunning[0] and t.stage == stage:
                    t.stash.append(args[0].detach().clone())  # this call's reference input, paired just after
                    return
                if not collecting(t):
                    return
                if reference:
                    t.stash.append(args[0].detach().to("cpu", copy=True))
                    return
                if t.dense is None:
                    t.dense = Accumulator(False, input_amax(mod))
                t.dense.add(args[0])
                if paired:
                    if not t.stash:
                        raise RuntimeError(f"gptq: {t.name} was called more often than in the reference forward")
                    if t.cross is None:
                        t.cross = _Cross(input_amax(mod))
                    t.cross.add_pair(t.stash.pop(0).to(args[0].device), args[0])

            handles.append(t.module.register_forward_pre_hook(add))  # after the Linear's input quantizer
        modules = {} if reference else {id(t.module): t.module for t in targets if t.param is not None}
        if stages is not None:
            for key, m in modules.items():
                group = experts[key]

                def seen(mod, args, kwargs, group=group):
                    for p in EXPERT_PARAMS:  # gate/up reads the layer's input, down a tensor of its own
                        if p in group:
                            stages.seen(group[p], (args[0] if args else kwargs["hidden_states"])
                                        if p == "gate_up_proj" else None)

                handles.append(m.register_forward_pre_hook(seen, prepend=True, with_kwargs=True))
        if paired and layers:
            handles += self._reruns(model, layers, targets, rerunning)
        set_mode(model, "off", role="weight")
        if not reference:
            for t in targets:  # the stages already updated run quantized (their GPTQ values)
                if t.quantizer.updated_weight is not None:
                    t.quantizer.mode = "quant"
        try:
            with ExitStack() as observing:
                for key, m in modules.items():
                    group = experts[key]
                    observing.enter_context(owner_inputs(m, expert_observer(
                        lambda group=group: {p: t.experts for p, t in group.items() if collecting(t)})))
                run_together("gptq Hessian forward", forward_loop, model)
        finally:
            for h in handles:
                h.remove()
            set_mode(model, "quant")
        self.passes += 1
        if reference:
            return
        # Dense sums over every rank (the same targets, module order, on every rank); experts stay with the owner.
        wanted = [t for t in dense if collecting(t)]
        for t in wanted:
            if t.dense is None:
                t.dense = Accumulator(False, input_amax(t.module))
            if t.stash:
                raise RuntimeError(f"gptq: {t.name} was called less often than in the reference forward")
        reduced = reduce_moments({id(t): t.dense for t in wanted}, {id(t): t.module for t in wanted}, blocks=False)
        for t in wanted:
            t.reduced = reduced[id(t)]
        if paired:
            for t in wanted:
                if t.cross is None:
                    t.cross = _Cross(input_amax(t.module))
            cross = reduce_moments({id(t): t.cross for t in wanted}, {id(t): t.module for t in wanted}, blocks=False)
            for t in wanted:
                t.cross_reduced = cross[id(t)][0]
                t.cross = None

    @staticmethod
    def _reruns(model: nn.Module, layers: dict[str, nn.Module], targets: list[_Target], rerunning: list[bool]) -> list:
        """Forward pre-hooks: each decoder layer reruns on its own arguments with its weights unquantized first
        (the reference inputs of the same layer input); the model's forward is asked ``use_cache=False`` so the
        rerun appends to no cache."""
        handles = []
        for prefix, layer in layers.items():
            inside = [t.quantizer for t in targets if t.name.startswith(f"{prefix}.")]

            def rerun(mod, args, kwargs, inside=inside):
                if rerunning[0]:
                    return None
                modes = [q.mode for q in inside]
                for q in inside:
                    q.mode = "off"
                leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
                versions = [x._version for x in leaves]
                rerunning[0] = True
                try:
                    mod(*args, **kwargs)
                finally:
                    rerunning[0] = False
                    for q, m in zip(inside, modes):
                        q.mode = m
                if [x._version for x in leaves] != versions:  # the real forward would see what the rerun wrote
                    raise RuntimeError(f"gptq asymmetric: decoder layer {type(mod).__name__} changed one of its "
                                       "arguments in place, so it cannot be rerun for its reference inputs; "
                                       "use asymmetric: false (or --layerwise)")
                return None

            handles.append(layer.register_forward_pre_hook(rerun, with_kwargs=True))
        if "use_cache" in inspect.signature(model.forward).parameters:
            def no_cache(mod, args, kwargs):
                return args, {**kwargs, "use_cache": False}

            handles.append(model.register_forward_pre_hook(no_cache, with_kwargs=True))
        return handles

    # ------------------------------------------------------------------ the updates

    def _update(self, t: _Target) -> None:
        damp, block = self.config.perc_damp, self.config.block_size
        q = t.quantizer
        if t.param is None:
            sums, tokens = t.reduced
            t.dense = t.reduced = None
            if tokens == 0:
                self.labels[t.name] = "max (no calibration tokens reached it)"
                return
            w = t.module.weight.detach()
            gs = q.scale().to(w.device)
            q.block_scale = nvfp4_block_scales(w, gs)  # max's, fixed: GPTQ moves values, not scales
            h = (2.0 * sums / tokens).to(torch.float32).to(w.device)
            target = w
            if t.cross_reduced is not None:
                target = asymmetric_target(w, sums, t.cross_reduced, damp)
                t.cross_reduced = None
            q.updated_weight = nvfp4_gptq(target, h, gs, q.block_scale, damp, block).to(w.dtype)
            label = str(self.algorithm)
        else:
            t.experts.reduce_over_replicas(t.module)  # replicated expert groups: every replica's tokens
            weight = getattr(t.module, t.param).detach()
            gs = q.scale().to(weight.device)
            scales = torch.stack([nvfp4_block_scales(weight[e], gs[e]) for e in range(weight.shape[0])])
            updated, idle = self._update_experts(t.experts, weight, gs, scales)
            if idle == weight.shape[0]:
                self.labels[t.name] = "max (no calibration tokens reached its experts)"
                return
            q.block_scale = scales
            q.updated_weight = updated
            label = str(self.algorithm) if not idle else \
                f"{self.algorithm} ({idle} of {weight.shape[0]} local experts got no tokens: max's values)"
        self.labels[t.name] = label
        self.weight_algorithms[t.name] = "gptq"  # max's scales, GPTQ's values: the update is the weight's

    def _update_experts(self, sums: ExpertSums, weight: torch.Tensor, gs: torch.Tensor,
                        scales: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The GPTQ values of one fused projection's local experts ``weight [E, out, in]`` (in its dtype), each from
        its own routed tokens (the same arithmetic whichever rank owns it), and how many got no token (they keep
        max's values). The experts with tokens are solved together (``nvfp4_gptq_batched``, equal to one at a time
        bit for bit), in chunks of as many experts as ``BATCH_BYTES`` holds (at least one): a chunk's working
        memory is at most ``max(BATCH_BYTES, one expert's)``, its Hessians, weight copy and
        ``gptq_batch_bytes`` included."""
        damp, block = self.config.perc_damp, self.config.block_size
        out_f, in_f = weight.shape[-2:]
        per_expert = gptq_batch_bytes(out_f, in_f, block) + 4 * in_f * in_f + 4 * out_f * in_f
        chunk = max(1, BATCH_BYTES // per_expert)
        updated, idle, pending = weight.clone(), 0, {}

        def solve() -> None:
            idx = torch.tensor(list(pending), device=weight.device)
            hessians = torch.stack(list(pending.values()))
            updated[idx] = nvfp4_gptq_batched(weight[idx], hessians, gs[idx], scales[idx], damp, block).to(weight.dtype)
            pending.clear()

        for e in range(weight.shape[0]):
            moments = sums.pop(e)
            if moments is None:
                idle += 1
                continue
            total, tokens = moments
            pending[e] = (2.0 * total / tokens).to(torch.float32).to(weight.device)
            if len(pending) == chunk:
                solve()
        if pending:
            solve()
        sums.clear()
        return updated, idle

    def calibrate(self, model: nn.Module, forward_loop: ForwardLoop | None,
                  groups: dict[str, tuple[str, ...]]) -> None:
        if forward_loop is None:
            raise ValueError("algorithm gptq needs calibration data (a forward_loop)")
        dense = nvfp4_linears(model)
        sharded = [n for n, m in model.named_modules() if id(m) in dense and is_sharded(m.weight)]
        if sharded:  # the same on every rank: refused before any collective
            raise ValueError(f"algorithm gptq updates whole weights, but {sharded[0]} is FSDP2-sharded: "
                             "use --plan whole or expert_parallel with --dense replicated")
        super().calibrate(model, forward_loop, groups)  # max: input scales, global scales, groups
        targets = self._targets(model)
        if not self.config.true_sequential:
            self._collect(model, forward_loop, targets, None, None)
            for t in targets:
                self._update(t)
            return
        layers = _decoder_layers(model, self.load)
        stages = _Stages([f"{n}." for n in layers])
        self._collect(model, forward_loop, targets, 0, stages)  # stage 0's Hessians; the stages found on the way
        # Stages are numbered at a target's first call, before its sums: pass 0 took exactly stage 0's.
        count = stages.assign(targets)
        unreached = [t for t in targets if t.stage is None]
        for t in targets:
            if t.stage == 0:
                self._update(t)
        asymmetric = self.config.asymmetric
        for stage in range(1, count):
            if asymmetric and not layers:  # one scope (a layerwise layer): the reference forward first
                self._collect(model, forward_loop, targets, stage, None, reference=True)
            self._collect(model, forward_loop, targets, stage, None, paired=asymmetric, layers=layers)
            for t in targets:
                if t.stage == stage:
                    self._update(t)
        for t in unreached:  # no forward called it: no Hessian
            self.labels[t.name] = "max (no calibration tokens reached it)"
