"""Expert coverage: how many calibration tokens each routed expert received, and the guard for starved ones.

Counting happens where routing is decided: a forward pre-hook on every fused experts module, which
transformers' experts interface calls as ``experts(hidden_states, top_k_index, top_k_weights)`` with
global expert ids on the rank the tokens come from (before any expert-parallel dispatch). Each rank
counts its own calibration tokens (``[num_global_experts]`` per layer); the totals are one small
all-reduce. Only while the layer's input quantizers calibrate, so held-out and other forwards do not count.

Which scales of an expert depend on calibration (``scale_dependence``): weight scales never do (they
come from the weights, or for MXFP4-sourced experts cast losslessly from the source exponents);
input scales do unless the recipe fixes ``input_amax``. Every expert of a layer shares one input scale
per projection (FORMATS.md), so an expert no token reached gets the layer's scale, measured on the
tokens routed to its other experts. The guard (``check_coverage``) turns that into a declared policy:

* ``refuse`` (default): refuse, naming the experts, when any of their scales depends on calibration;
* ``shared``: accept the layer's shared input scale for them (what ModelOpt does);
* ``calibrate_all``: every expert sees every calibration token (``calibrate_all_experts``), decided
  before calibration, so nothing is starved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..dist.group import current_group
from .modules import ExpertsQuantState

POLICIES = ("refuse", "shared", "calibrate_all")


class CoverageError(ValueError):
    """Experts received fewer calibration tokens than required and the policy refuses them."""


class TokenCounter:
    """This rank's calibration tokens per global expert of one MoE layer (``routed``) and the tokens that
    entered the layer (``seen``: what ``calibrate_all_experts`` pushes through every expert)."""

    def __init__(self, num_experts: int) -> None:
        self.routed = torch.zeros(num_experts, dtype=torch.int64)
        self.seen = 0
        self.calls = 0  # forwards counted: 0 when no calibration forward reached the layer's input quantizers

    def __call__(self, module: nn.Module, args, kwargs) -> None:
        state: ExpertsQuantState = module.quant
        if not any(q.mode == "calib" for q in state.input.values()):
            return
        ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
        self.routed += torch.bincount(ids.reshape(-1).long(), minlength=self.routed.numel()).cpu()
        self.seen += int(ids.shape[0])
        self.calls += 1


def attach_token_counter(experts: nn.Module) -> TokenCounter:
    counter = TokenCounter(experts.placement.num_experts)
    experts.token_counter = counter
    experts.register_forward_pre_hook(counter, with_kwargs=True)
    return counter


@dataclass
class LayerCoverage:
    """One MoE layer: totals over all ranks, per global expert."""

    module: str
    routed: list[int]  # tokens routed to each expert in calibration
    handled: list[int]  # tokens each expert calibrated on (all tokens under calibrate_all_experts)
    calibrate_all: bool
    dependence: dict[str, dict[str, str]]  # fused param -> {"weight": why, "input": why}
    input_scales: dict[str, float | None]  # fused param -> the layer's shared input scale (None: not quantized)
    by_rank: list[list[int]] = field(default_factory=list)  # filled by the report (rank 0)

    def depends_on_calibration(self) -> bool:
        return any(d["input"].startswith("calibrated") for d in self.dependence.values())

    def uncovered(self, min_tokens: int) -> list[int]:
        return [e for e, n in enumerate(self.handled) if n < min_tokens]


def scale_dependence(state: ExpertsQuantState) -> dict[str, dict[str, str]]:
    """Per fused parameter: where its weight and input scales come from, and whether calibration is involved."""
    out = {}
    for param, wq in state.weight.items():
        if wq.source is not None:
            weight = "no calibration: power-of-two scales carried from the MXFP4 source exponents (lossless cast)"
        elif wq.fmt.per_tensor_scale:
            weight = "no calibration: from the weights' amax"
        else:
            weight = "no calibration: each block's scale from its own weights"
        iq = state.input[param] if param in state.input else None
        if iq is None:
            inputs = "none: inputs not quantized"
        elif iq.constant_amax is not None:
            inputs = f"no calibration: constant input_amax {iq.constant_amax:g} from the recipe"
        else:
            inputs = ("calibrated: one input_scale per layer, the max over the tokens routed to any of "
                      "its experts (all ranks)")
        out[param] = {"weight": weight, "input": inputs}
    return out


def expert_coverage(model: nn.Module, spec, within: Callable[[str], bool] | None = None) -> list[LayerCoverage]:
    """Every MoE layer's coverage (of the experts modules ``within`` holds, default all), totals summed over
    ranks (one all-reduce; call on every rank). Layers no calibration forward was counted in (a recipe whose
    expert inputs need no data) are left out."""
    layers = [(name, m) for name, m in spec.experts_modules(model).items()
              if hasattr(m, "token_counter") and (within is None or within(name))]
    if not layers:
        return []
    group = current_group()
    local = torch.stack([m.token_counter.routed for _, m in layers])
    seen = torch.tensor([[m.token_counter.seen, m.token_counter.calls] for _, m in layers], dtype=torch.int64)
    both = torch.cat([local.reshape(-1), seen.reshape(-1)]).to(group.device)
    if group.world_size > 1:
        dist.all_reduce(both, group=group.pg)
    both = both.cpu()
    totals = both[: local.numel()].view_as(local).tolist()
    seen_total = both[local.numel():].view(-1, 2).tolist()
    out = []
    for (name, m), routed, (n_seen, calls) in zip(layers, totals, seen_total):
        if calls == 0:
            continue
        state: ExpertsQuantState = m.quant
        everyone = state.calibrate_all_experts
        out.append(LayerCoverage(
            module=name, routed=routed, handled=[n_seen] * len(routed) if everyone else list(routed),
            calibrate_all=everyone, dependence=scale_dependence(state),
            input_scales={p: (float(state.input[p].scale()) if p in state.input and state.input[p].calibrated
                              else None) for p in state.weight},
        ))
    return out


def uncovered_explanation(layer: LayerCoverage, expert: int, policy: str) -> dict[str, object]:
    """What scales an uncovered expert got and why (one entry of the report)."""
    scales = {}
    for param, dep in layer.dependence.items():
        value = layer.input_scales.get(param)
        if value is None:
            scales[param] = {"input_scale": None, "why": dep["input"], "weight": dep["weight"]}
            continue
        others = sum(layer.routed) - layer.routed[expert]
        why = (f"the layer's shared input_scale ({dep['input']}); this expert saw {layer.handled[expert]} "
               f"token(s), the layer's other experts {others} routed token-slot(s)")
        if layer.calibrate_all:
            why = f"calibrated on all {layer.handled[expert]} tokens of the layer (calibrate_all_experts)"
        elif not dep["input"].startswith("calibrated"):
            why = dep["input"]
        scales[param] = {"input_scale": value, "why": why, "weight": dep["weight"]}
    return {"expert": expert, "routed": layer.routed[expert], "handled": layer.handled[expert],
            "policy": policy, "scales": scales}


def check_coverage(coverage: list[LayerCoverage], *, min_tokens: int, policy: str) -> list[str]:
    """Apply ``policy`` to experts below ``min_tokens``: raise ``CoverageError`` naming them (``refuse``,
    when a scale of theirs depends on calibration), else return one note per layer that has some."""
    if policy not in POLICIES:
        raise ValueError(f"uncovered-experts policy {policy!r} is not one of {list(POLICIES)}")
    refused, notes = [], []
    for layer in coverage:
        starved = layer.uncovered(min_tokens)
        if not starved:
            continue
        depends = layer.depends_on_calibration()
        if policy == "refuse" and depends:
            refused.append(f"{layer.module}: experts {starved} (tokens {[layer.handled[e] for e in starved]})")
        elif depends:
            notes.append(f"{layer.module}: experts {starved} got fewer than {min_tokens} calibration token(s); "
                         f"they take the layer's shared input scale (--uncovered_experts {policy})")
        else:
            notes.append(f"{layer.module}: experts {starved} got fewer than {min_tokens} calibration token(s); "
                         "none of their scales depends on calibration")
    if refused:
        raise CoverageError(
            f"{len(refused)} MoE layer(s) have experts with fewer than {min_tokens} calibration token(s), and "
            f"their input scales depend on calibration: {'; '.join(refused)}. Give more or more varied "
            "calibration data, or choose a policy: --uncovered_experts shared (the layer's shared input "
            "scale) or calibrate_all (every expert sees every token)"
        )
    return notes


def guard_coverage(model: nn.Module, spec, *, min_tokens: int, policy: str,
                   within: Callable[[str], bool] | None = None, say=print) -> list[LayerCoverage]:
    """``--min_expert_tokens``/``--uncovered_experts`` before an export is written: the coverage of the experts
    ``within`` holds (a resident run: all, once; a layerwise run: one layer's, before that layer is written),
    refused (``CoverageError``) or noted through ``say``; returns the coverage for the report. Counters count
    only calibration forwards, so a layer's counts are final once it calibrated: the layerwise lists, in layer
    order, are the resident list."""
    coverage = expert_coverage(model, spec, within)
    for note in check_coverage(coverage, min_tokens=min_tokens, policy=policy):
        say(f"[modelopt_k3] uncovered experts: {note}")
    return coverage
