"""``nvfp4_act_headroom``: NVFP4 input (activation) global scales with headroom above the calibrated range
(nvidia-modelopt 0.47 ``nvfp4_act_headroom_calibrate``, ``NVFP4ActHeadroomCalibrator``); weights by max.

Max sets an input's per-tensor scale from the largest value calibration saw, so any larger activation at
serving time saturates. This rule anchors the scale to a low percentile of the per-16-block amaxes instead:

    amax = max(rho * anchor, upper)

``anchor``: the per-block amax at ``anchor_percentile`` (blocks below ``upper / 1e6`` ignored, so a tail of
near-zero blocks cannot pull it down); ``upper``: the one at ``upper_percentile`` (99.99: a lone freak block is
clipped rather than flushing every other block's E4M3 scale to zero; 100: the observed max). ``rho * anchor``
places the calibrated blocks in the low part of the E4M3 scale range, the rest is headroom. The percentiles
come from a histogram of ``log2(block amax)`` (512 bins over [-40, 40], a percentile read at its bin's centre),
ModelOpt's statistic, so the same tokens give ModelOpt's amax.

Under EP (and any data parallelism) each rank counts its own tokens' blocks; the counts are integers, summed
over ranks, so N ranks get one process's histogram and amax exactly. ModelOpt instead max-reduces the per-rank
amaxes, which depends on how tokens are split. Refused: ``calibrate_all_experts`` with replicated expert groups,
which pushes every token through each replica of an expert, so the replicas' down-input blocks would be counted
once per replica (max, idempotent, does not mind).

Which quantizers: NVFP4 input quantizers without a constant amax (ModelOpt: NVFP4 dynamic-block input
quantizers); the rest, and every weight, are max's. Shared-input groups then take their members' max, as
under max. ModelOpt's nested ``weight_scale_algorithm`` (mse / local_hessian weights in the same pass) is not
an option here: weights are max's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ...dist.group import current_group
from ...numerics.constants import NVFP4_BLOCK
from ...recipe.algorithm import AlgorithmError
from ..modules import ExpertsQuantState, iter_quantizers
from ..quantizer import TensorQuantizer
from ..schemes import NVFP4_TENSOR
from .base import AlgorithmConfig, ForwardLoop, register_calibrator
from .max import MaxCalibrator

HIST_BINS = 512
LOG2_RANGE = (-40.0, 40.0)  # the log2(block amax) the bins cover; outside, the end bins
ANCHOR_FLOOR_RATIO = 1e6  # blocks below upper / this are not counted for the anchor
FP8_NORMAL_RANGE = 448.0 / 2.0**-6  # E4M3 max normal / min normal: rho must stay below it


# ------------------------------------------------------------------------------ the statistic (pure)


def log2_bins(log2_amax: torch.Tensor) -> torch.Tensor:
    """The histogram bin of each ``log2(amax)`` (float32), clamped to the end bins."""
    lo, hi = LOG2_RANGE
    return ((log2_amax - lo) / (hi - lo) * HIST_BINS).floor().long().clamp(0, HIST_BINS - 1)


def bin_value(index: int) -> float:
    """A bin's representative amax: 2 to the power of its centre."""
    lo, hi = LOG2_RANGE
    return float(2.0 ** (lo + (index + 0.5) / HIST_BINS * (hi - lo)))


def block_amax_counts(x: torch.Tensor, block: int = NVFP4_BLOCK) -> torch.Tensor:
    """``[HIST_BINS]`` int64 counts (on ``x``'s device) of ``log2`` of the amax of each nonzero ``block`` along
    ``x``'s last dim (a ragged tail zero-padded: padding changes no block's amax)."""
    x = x.detach()
    if x.shape[-1] % block:
        x = nn.functional.pad(x, (0, block - x.shape[-1] % block))
    amax = x.abs().reshape(-1, block).amax(dim=-1).float()
    amax = amax[amax > 0]
    return torch.bincount(log2_bins(torch.log2(amax)), minlength=HIST_BINS)


def counts_percentile(counts: torch.Tensor, percentile: float, floor: float | None = None) -> float | None:
    """The amax at ``percentile`` of the histogram (the first bin whose cumulative count reaches it), bins
    below ``floor``'s left out; None for an empty histogram. Counted in float32, as ModelOpt counts, so the
    chosen bin is ModelOpt's on the same counts."""
    weights = counts.to(torch.float32)
    if floor is not None and floor > 0:
        weights[: int(log2_bins(torch.log2(torch.tensor(floor, dtype=torch.float32))))] = 0
    total = weights.sum()
    if total <= 0:
        return None
    cumulative = weights.cumsum(0)
    return bin_value(int(torch.searchsorted(cumulative, percentile / 100.0 * total).clamp(0, HIST_BINS - 1)))


def headroom_amax(counts: torch.Tensor, observed_max: float, anchor_percentile: float, upper_percentile: float,
                  rho: float) -> tuple[torch.Tensor, str]:
    """(the input amax, which term chose it: ``headroom`` rho*anchor, ``upper``, or ``max`` where the
    percentiles collapsed) of one quantizer's block-amax ``counts`` and its observed max."""
    upper = observed_max if upper_percentile >= 100.0 else counts_percentile(counts, upper_percentile)
    anchor = counts_percentile(counts, anchor_percentile, upper / ANCHOR_FLOOR_RATIO) if upper else None
    if not upper or upper <= 0 or not anchor or anchor <= 0:
        chosen, which = observed_max, "max"
    elif rho * anchor <= upper:
        chosen, which = upper, "upper"
    else:
        chosen, which = rho * anchor, "headroom"
    return torch.tensor(float(chosen), dtype=torch.float32), which


# ------------------------------------------------------------------------------ config and handler


@dataclass(frozen=True)
class ActHeadroomConfig(AlgorithmConfig):
    """``algorithm: {method: nvfp4_act_headroom, ...}``, ModelOpt 0.47's ``NVFP4ActHeadroomCalibConfig``
    defaults. ``--qformat nvfp4_act_headroom``: NVFP4 with this rule and max weights."""

    method = "nvfp4_act_headroom"
    presets = {"act_headroom": {}}

    anchor_percentile: float = 1.0
    upper_percentile: float = 99.99
    rho: float = 16384.0

    def check(self) -> None:
        for name in ("anchor_percentile", "upper_percentile"):
            if not 0.0 < getattr(self, name) <= 100.0:
                raise AlgorithmError(f"algorithm nvfp4_act_headroom: {name} must be in (0, 100], got {getattr(self, name)}")
        if not 0.0 < self.rho < FP8_NORMAL_RANGE:
            raise AlgorithmError(f"algorithm nvfp4_act_headroom: rho must be in (0, {FP8_NORMAL_RANGE:.0f}) (the E4M3 "
                                 f"normal range: above it no block scale below the anchor stays normal), got {self.rho}")


def headroom_inputs(model: nn.Module) -> dict[str, TensorQuantizer]:
    """The input quantizers the rule sets: NVFP4, calibrated (no constant amax); in module order."""
    return {name: q for name, q in iter_quantizers(model)
            if q.role == "input" and q.fmt is NVFP4_TENSOR and q.constant_amax is None}


def recounted_experts(model: nn.Module) -> list[str]:
    """Experts modules that would count tokens more than once: every token through every local expert
    (``calibrate_all_experts``) on an expert block that other ranks hold too (``placement.replicas``)."""
    out = []
    for name, m in model.named_modules():
        state = getattr(m, "quant", None)
        replicas = getattr(getattr(m, "placement", None), "replicas", None)
        if isinstance(state, ExpertsQuantState) and state.calibrate_all_experts and replicas is not None \
                and dist.get_world_size(replicas) > 1:
            out.append(name)
    return out


def counting_blocks(inputs: dict[str, TensorQuantizer], counts: dict[str, torch.Tensor], mode: str) -> list:
    """Hooks adding each input's block-amax histogram into ``counts`` (name -> int64 ``[HIST_BINS]``) whenever
    its quantizer runs in ``mode``; the handles, for the caller to remove."""
    def count(name: str):
        def hook(q: TensorQuantizer, args: tuple) -> None:
            if q.mode == mode:  # counted where the activation is (no host sync per batch)
                c = block_amax_counts(args[0])
                counts[name] = counts[name].to(c.device) + c
        return hook

    return [q.register_forward_pre_hook(count(name)) for name, q in inputs.items()]


def summed_over_ranks(counts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The histograms summed over the run group (integers: exact in any order); on the host."""
    g = current_group()
    if g.world_size == 1 or not counts:
        return {n: c.cpu() for n, c in counts.items()}
    names = list(counts)
    summed = torch.stack([counts[n].to(g.device) for n in names])
    dist.all_reduce(summed, group=g.pg)
    return dict(zip(names, summed.cpu()))


# headroom_amax's term -> why the rule added no headroom (the labels' words); "headroom" is not listed
NO_HEADROOM = {"upper": "no headroom at this rho", "max": "percentiles collapsed"}


def set_headroom_amaxes(inputs: dict[str, TensorQuantizer], counts: dict[str, torch.Tensor],
                        config: ActHeadroomConfig) -> dict[str, str]:
    """Each calibrated input's amax by the rule, from its histogram and its max-calibrated amax (the observed
    max); the inputs where the rule added no headroom, and which term chose their amax (``NO_HEADROOM``'s keys)."""
    kept = {}
    for name, q in inputs.items():
        if not q.calibrated or q.saw_nonfinite:
            continue  # max's finalize refuses these, naming them
        amax, which = headroom_amax(counts[name], float(q.amax), config.anchor_percentile,
                                    config.upper_percentile, config.rho)
        q.amax.copy_(amax.to(q.amax.device))
        if which != "headroom":
            kept[name] = which
    return kept


def refuse_recounted(model: nn.Module, who: str) -> None:
    recounted = recounted_experts(model)
    if recounted:
        raise ValueError(f"{who}: {recounted[0]} pushes every token through every replica of its experts "
                         "(calibrate_all_experts with replicated expert groups), so its histogram would count them "
                         "once per replica: calibrate without --calibrate_all_experts, or with --ep_degree equal to "
                         "the world size")


@register_calibrator
class ActHeadroomCalibrator(MaxCalibrator):
    config_type = ActHeadroomConfig

    def __init__(self, algorithm, config) -> None:
        super().__init__(algorithm, config)
        self.counts: dict[str, torch.Tensor] = {}  # input quantizer name -> block-amax histogram

    def observe(self, model: nn.Module, forward_loop: ForwardLoop | None) -> None:
        """Max's forward, each rule input also counting the blocks it observes (the tensors max folds in)."""
        refuse_recounted(model, "algorithm nvfp4_act_headroom")
        inputs = headroom_inputs(model)
        self.counts = {name: torch.zeros(HIST_BINS, dtype=torch.int64) for name in inputs}
        handles = counting_blocks(inputs, self.counts, "calib")
        try:
            super().observe(model, forward_loop)
        finally:
            for h in handles:
                h.remove()

    def reduce(self, model: nn.Module) -> None:
        """Max's amax reduction, and the histograms summed over ranks (integers: exact in any order)."""
        super().reduce(model)
        self.counts = summed_over_ranks(self.counts)

    def finalize(self, model: nn.Module, groups: dict[str, tuple[str, ...]]) -> None:
        for name, which in set_headroom_amaxes(headroom_inputs(model), self.counts, self.config).items():
            self.labels[name] = f"{self.algorithm} ({which}: {NO_HEADROOM[which]})"
        self.counts = {}
        super().finalize(model, groups)  # refusals, quant mode, shared-input groups, max's weights
