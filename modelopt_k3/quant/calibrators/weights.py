"""The per-weight step shared by the NVFP4 weight algorithms: visit every NVFP4 weight quantizer this
rank owns and give it the block scales a search picks.

Dense Linears are whole on every rank (replicated); a fused experts module holds only this rank's
experts (expert parallel), so each owner searches its own experts and nothing per expert travels.
Skipped, keeping max's scales: weights cast losslessly from MXFP4 (the cast is exact and already the
source's own scales; no search can improve it), and non-NVFP4 weights. FSDP2-sharded weights are
refused (a search needs the whole weight; the gather-to-owner path is not built).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ...dist.fsdp import is_sharded
from ...experts.packed import expert_weight_rows
from ..modules import ExpertsQuantState
from ..quantizer import TensorQuantizer
from ..schemes import NVFP4_TENSOR
from .base import LOSSLESS_CAST

EXPERTS_PER_SEARCH = 16  # experts searched at a time (bounds the temporaries)
SKIPPED_MXFP4 = "max (lossless MXFP4 cast: weight algorithms skip it)"
# What produced a weight's scales, as the report's ``weight_algorithm`` names it, is recorded per weight quantizer
# by the calibrator that set them (``Calibrator.weight_algorithms``); ``base.weight_algorithm_names()`` lists them.

# (weight [..., out, in], global scale (0-d, or [e] for experts), owner module, param, the local experts its
# rows are (None: a dense weight)) -> e4m3 block scales
Search = Callable[[torch.Tensor, torch.Tensor, nn.Module, str, "range | None"], torch.Tensor]


@dataclass
class WeightSite:
    """One NVFP4 weight quantizer: ``name`` (the Linear, or ``experts.param``), its owner and param."""

    name: str
    module: nn.Module
    param: str
    quantizer: TensorQuantizer
    experts: bool


def weight_sites(model: nn.Module) -> Iterator[WeightSite]:
    for name, module in model.named_modules():
        wq = getattr(module, "weight_quantizer", None)
        if type(module) is nn.Linear and isinstance(wq, TensorQuantizer):
            yield WeightSite(name, module, "weight", wq, False)
        state = getattr(module, "quant", None)
        if isinstance(state, ExpertsQuantState):
            for param, q in state.weight.items():
                yield WeightSite(f"{name}.{param}", module, param, q, True)


def max_algorithm(q: TensorQuantizer) -> str:
    """Max's decision for one weight quantizer: ``lossless_cast`` for MXFP4-sourced experts and passed-through
    block-FP8 Linears (whose scales are the source's, whatever the algorithm), else ``max``."""
    return LOSSLESS_CAST if q.source is not None or q.passes_through else "max"


def max_algorithms(model: nn.Module, algorithms: dict[str, str]) -> None:
    """``max_algorithm`` for every weight quantizer. A weight algorithm overwrites the sites it searches."""
    for site in weight_sites(model):
        algorithms[site.name] = max_algorithm(site.quantizer)


def search_sites(model: nn.Module, method: str, search: Search, labels: dict[str, str],
                 choice: Callable[[WeightSite], tuple[str, str]], algorithms: dict[str, str],
                 global_scale: Callable[[TensorQuantizer], torch.Tensor] | None = None) -> None:
    """Set ``block_scale`` (and with ``global_scale`` the per-tensor ``fixed_scale``) of every eligible
    NVFP4 weight quantizer from ``search``. ``choice(site)``: (the ``weight_algorithm_names()`` entry, the label) of
    the search that site gets; ``algorithms[name]`` and ``labels[name]`` record them (skipped sites: max's)."""
    for site in weight_sites(model):
        q = site.quantizer
        if q.fmt is not NVFP4_TENSOR:
            labels[site.name] = "max (not NVFP4)"
            algorithms[site.name] = max_algorithm(q)
            continue
        if q.source is not None:
            labels[site.name] = SKIPPED_MXFP4
            algorithms[site.name] = LOSSLESS_CAST
            continue
        weight = getattr(site.module, site.param, None)
        if weight is not None and is_sharded(weight):
            raise ValueError(f"algorithm {method} searches whole weights, but {site.name} is FSDP2-sharded: "
                             "use --plan whole or expert_parallel with --dense replicated")
        if global_scale is not None:
            q.fixed_scale = global_scale(q).to(q.amax.device)
        gs = q.scale()
        if site.experts:
            q.block_scale = _search_experts(site, gs, search)
        else:
            weight = site.module.weight.detach()
            q.block_scale = search(weight, gs.to(weight.device), site.module, "weight", None)
        algorithms[site.name], labels[site.name] = choice(site)


def _search_experts(site: WeightSite, gs: torch.Tensor, search: Search) -> torch.Tensor:
    n = site.quantizer.amax.shape[0]
    parts = []
    for start in range(0, n, EXPERTS_PER_SEARCH):
        part = slice(start, min(start + EXPERTS_PER_SEARCH, n))
        w = expert_weight_rows(site.module, site.param, part)
        parts.append(search(w, gs[part].to(w.device), site.module, site.param, range(part.start, part.stop)))
    return torch.cat(parts)
