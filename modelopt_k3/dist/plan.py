"""The distribution plan: decided once, from the meta-built config, the world size and the spec.

Everything downstream (load, calibration, export) reads the plan instead of re-guessing from the
environment.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch

from ..spec import ModelSpec
from .kinds import (
    AUTO,
    DENSE_MODES,
    EXPERTS_CHOICES,
    PLAN_KINDS,
    DenseMode,
    PlanKind,
    Residency,
    allowed_residencies,
    residency_refusal,
)
from .placement import ExpertPlacement, Placement, PlanError, ResidencyError

__all__ = [
    "AUTO", "DENSE_MODES", "EXPERTS_CHOICES", "PLAN_KINDS", "DenseMode", "DistributionPlan",
    "IneffectiveSettingWarning", "PlanError", "PlanKind", "Residency", "ResidencyError", "allowed_residencies",
    "check_request_names", "decide_plan", "residency_refusal",
]


class IneffectiveSettingWarning(UserWarning):
    """A setting the user made that this plan cannot act on (it is accepted, and has no effect)."""


@dataclass(frozen=True)
class DistributionPlan:
    kind: PlanKind
    rank: int
    world_size: int
    ep_degree: int
    device: torch.device
    experts_implementation: str
    # Which rank holds (and writes) which routed experts; ``build_placement`` adds the mesh and group.
    expert_placement: ExpertPlacement
    # Expert parallel only: the dense part "replicated" on every rank, or "fsdp2"-sharded over the world.
    dense: DenseMode = DenseMode.REPLICATED
    # What runs this rank's own experts: the owner's implementation under torch_a2a, else the
    # implementation itself (``default_local_implementation``).
    local_experts_implementation: str = "eager"
    # Experts held decoded ("bf16") or as their MXFP4 source bytes ("packed", experts/packed.py),
    # and for packed the experts decoded at a time (None: a whole layer). Set by ``with_residency``.
    experts_residency: Residency = Residency.BF16
    decode_chunk: int | None = None

    @property
    def fsdp_sharded(self) -> bool:
        """Whether FSDP2 shards anything (the fsdp2 plan, or the dense part under expert parallelism)."""
        return self.kind is PlanKind.FSDP2 or self.dense is DenseMode.FSDP2

    def layerwise_refusal(self) -> str | None:
        """Why a layerwise run cannot use this plan, None when it can: it reads whole decoder layers per rank,
        which FSDP2 shards. The one wording the preflight, the layerwise loader and the planner's table say."""
        if not self.fsdp_sharded:
            return None
        named = f"expert_parallel with dense {self.dense}" if self.expert_parallel else str(self.kind)
        return (f"--layerwise reads whole layers per rank; plan {named} shards them with FSDP2: use --plan "
                "expert_parallel with --dense replicated, or --plan whole")

    @property
    def expert_parallel(self) -> bool:
        return self.kind is PlanKind.EXPERT_PARALLEL

    @property
    def replica(self) -> int:
        """Which copy of the experts this rank belongs to (world / ep_degree copies, ranks grouped contiguously)."""
        return self.rank // self.ep_degree if self.expert_parallel else 0

    def build_placement(self) -> Placement:
        """The run's device mesh and expert placement (collective: every rank calls it once, in the same order).

        ``fsdp`` over the world for plan fsdp2; ``replica`` x ``ep`` for expert parallelism (EP groups of
        contiguous ranks, the layout ``replica`` assumes); no mesh in one process.
        """
        if self.world_size == 1:
            return Placement(self.expert_placement)
        from torch.distributed.device_mesh import init_device_mesh

        if self.expert_parallel:
            shape, names = (self.world_size // self.ep_degree, self.ep_degree), ("replica", "ep")
        else:
            shape, names = (self.world_size,), ("fsdp",)
        mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        group = mesh["ep"].get_group() if self.expert_parallel else None
        # Ranks that hold the same experts (EP groups replicated over the world): the replica axis.
        replicas = mesh["replica"].get_group() if self.expert_parallel and shape[0] > 1 else None
        return Placement(self.expert_placement.with_group(group, replicas), mesh)

    def describe(self) -> str:
        text = f"plan={self.kind} world={self.world_size} rank={self.rank}"
        if self.expert_parallel:
            text += f" ep={self.ep_degree} experts_implementation={self.experts_implementation} dense={self.dense}"
        text += f" local_experts={self.local_experts_implementation} experts={self.experts_residency}"
        if self.experts_residency is Residency.PACKED:
            text += f" decode_chunk={self.decode_chunk or 'layer'}"
        return text

    def with_residency(self, residency: Residency | str, decode_chunk: int | None = None, *,
                       packed_source: bool = True) -> DistributionPlan:
        """This plan with the experts' residency decided (``load_pretrained``, from the memory planner);
        refuses what ``residency_refusal`` refuses (``ResidencyError``)."""
        why = residency_refusal(self.kind, residency, packed_source=packed_source)
        if why is not None:
            raise ResidencyError(why)
        residency = Residency(residency)
        if decode_chunk is not None and (residency is not Residency.PACKED or decode_chunk < 1):
            raise PlanError(f"decode_chunk={decode_chunk} needs packed experts and at least 1 expert")
        return dataclasses.replace(self, experts_residency=residency, decode_chunk=decode_chunk)


def default_local_implementation(device: torch.device, dtype: torch.dtype | None = None, *,
                                 capability: tuple[int, int] | None = None) -> str:
    """The implementation that runs a rank's own experts when the user names none.

    grouped_mm for bf16 weights on CUDA where transformers would use the kernel (compute capability
    >= 8.0 with ``torch.nn.functional.grouped_mm``; transformers integrations/moe.py
    ``_can_use_grouped_mm``; the kernel takes bf16 only, per torch's ``grouped_mm`` docs), else eager.
    Never batched_mm: it gathers one weight matrix per (token, expert) pair, a calibration batch's worth
    of expert matrices. On CPU grouped_mm runs a per-group loop, no faster than eager. ``capability``: the
    compute capability of a device planned for that is not this machine's (the memory planner's
    ``PLANNED_CAPABILITY``); None queries ``device``.
    """
    if device.type == "cuda" and hasattr(torch.nn.functional, "grouped_mm") and dtype in (None, torch.bfloat16):
        if (capability or torch.cuda.get_device_capability(device)) >= (8, 0):
            return "grouped_mm"
    return "eager"


def _check_local_implementation(name: str) -> None:
    if name == "eager":  # the experts class's own loop: no registry to ask (importing it costs ~1 s)
        return
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if name not in ALL_EXPERTS_FUNCTIONS:
        raise PlanError(
            f"unknown experts implementation {name!r}; choose 'eager' or one registered with transformers' "
            f"experts interface: {sorted(ALL_EXPERTS_FUNCTIONS.keys())}"
        )


def _check_fsdp2(
    spec: ModelSpec, num_experts: int, world_size: int, ep_degree: int | None, experts_implementation: str | None
) -> None:
    """Refuse an fsdp2 run that cannot work, before anything is built or read."""
    if world_size < 2:
        raise PlanError("plan 'fsdp2' shards over the ranks of a torchrun launch, but WORLD_SIZE=1; use 'whole'")
    if ep_degree not in (None, 1):
        raise PlanError(f"an expert-parallel degree ({ep_degree}) applies to plan 'expert_parallel', not 'fsdp2'")
    if experts_implementation == "torch_a2a":
        raise PlanError("'torch_a2a' dispatches to expert-parallel owners; plan 'fsdp2' runs every expert locally")
    bad_dims = {p: d for p, d in spec.experts.sharded_params.items() if d != 0}
    if bad_dims:
        raise PlanError(f"plan 'fsdp2' shards dim 0, but {spec.model_type!r} indexes experts on other dims: {bad_dims}")
    if spec.experts.sharded_params and num_experts % world_size:
        raise PlanError(
            f"num_experts={num_experts} is not divisible by WORLD_SIZE={world_size}: plan 'fsdp2' gives every "
            "rank the same number of whole experts; choose a world size that divides it"
        )


def decide_plan(
    requested: str,
    *,
    spec: ModelSpec,
    num_experts: int,
    rank: int,
    world_size: int,
    device: torch.device,
    ep_degree: int | None = None,
    experts_implementation: str | None = None,
    dense: DenseMode = DenseMode.REPLICATED,
    dtype: torch.dtype | None = None,
) -> DistributionPlan:
    """The plan for this run, decided once before any weight is read; refuses (``PlanError``) what cannot work."""
    kind = _resolve_kind(requested, dense, spec, world_size)
    dense = DenseMode(dense)
    if kind is PlanKind.FSDP2:
        _check_fsdp2(spec, num_experts, world_size, ep_degree, experts_implementation)
    if kind is PlanKind.EXPERT_PARALLEL:
        ep_degree, experts, impl, local = _expert_parallel_choice(
            num_experts, rank, world_size, ep_degree, experts_implementation, dense, device, dtype)
    else:
        if dense is not DenseMode.REPLICATED:
            raise PlanError(f"dense={dense!r} applies to plan 'expert_parallel' (plan '{kind}' decides it itself)")
        _warn_ineffective(kind, ep_degree, experts_implementation)
        ep_degree = 1
        impl = experts_implementation or default_local_implementation(device, dtype)
        # torch_a2a in one process dispatches to itself: the local implementation runs the experts.
        local = impl if impl != "torch_a2a" else default_local_implementation(device, dtype)
        # fsdp2: every rank writes the expert rows of its own shards; whole: the one rank writes them all.
        experts = ExpertPlacement(num_experts)
    _check_local_implementation(local)
    return DistributionPlan(kind, rank, world_size, ep_degree, device, impl, experts, dense, local)


def check_request_names(requested: str, dense: str, experts: str = AUTO) -> None:
    """Refuse an unknown plan, dense sharding or experts residency name (``PlanError``/``ResidencyError``), the
    way ``decide_plan`` and ``with_residency`` word it: also before a library call's ``PtqConfig`` is made."""
    if requested not in PLAN_KINDS:
        raise PlanError(f"unknown plan {requested!r}; choose one of {list(PLAN_KINDS)}")
    if dense not in DENSE_MODES:
        raise PlanError(f"unknown dense sharding {dense!r}; choose one of {list(DENSE_MODES)}")
    if experts != AUTO:
        why = residency_refusal(PlanKind.WHOLE, experts, packed_source=True)  # the name alone
        if why is not None:
            raise ResidencyError(why)


def _resolve_kind(requested: str, dense: str, spec: ModelSpec, world_size: int) -> PlanKind:
    """The plan kind (``auto`` resolved), after checking the names and what the world size allows."""
    check_request_names(requested, dense)
    has_ep = bool(spec.experts.sharded_params)
    if requested == AUTO:
        kind = PlanKind.EXPERT_PARALLEL if world_size > 1 and has_ep else (
            PlanKind.FSDP2 if world_size > 1 else PlanKind.WHOLE)
    else:
        kind = PlanKind(requested)
    if kind is PlanKind.WHOLE and world_size > 1:
        raise PlanError(
            f"plan 'whole' runs in one process, but WORLD_SIZE={world_size}; use 'expert_parallel' or 'auto'"
        )
    if kind is PlanKind.EXPERT_PARALLEL and not has_ep:
        raise PlanError(f"model_type {spec.model_type!r} declares no expert-parallel plan")
    return kind


def _expert_parallel_choice(
    num_experts: int, rank: int, world_size: int, ep_degree: int | None, experts_implementation: str | None,
    dense: DenseMode, device: torch.device, dtype: torch.dtype | None,
) -> tuple[int, ExpertPlacement, str, str]:
    """(EP degree, this rank's placement, ``torch_a2a``, the owner's implementation) for expert parallelism."""
    if ep_degree is None:  # the whole world (a command line may have read $MODELOPT_K3_EP_DEGREE for it)
        ep_degree = world_size
    if ep_degree < 1 or world_size % ep_degree:
        raise PlanError(
            f"expert-parallel degree {ep_degree} must divide the world size {world_size}; choose one of "
            f"{[d for d in range(1, world_size + 1) if world_size % d == 0]} (CLI: --ep_degree)"
        )
    if num_experts % ep_degree:  # suggest only degrees that divide the world size too (the rule just above)
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0 and num_experts % d == 0]
        raise PlanError(
            f"num_experts={num_experts} is not divisible by the expert-parallel degree {ep_degree}; with world size "
            f"{world_size} choose a degree that divides both: one of {fits} (CLI: --ep_degree)"
        )
    # Replica 0 (ranks below ep_degree) writes the experts.
    experts = ExpertPlacement(num_experts, ep_degree, rank % ep_degree, writes_experts=rank < ep_degree)
    impl = "torch_a2a"
    # A named implementation runs the owner's experts; torch_a2a dispatches to them.
    local = experts_implementation if experts_implementation not in (None, impl) else None
    local = local or default_local_implementation(device, dtype)
    if dense is DenseMode.FSDP2 and ep_degree != world_size:
        raise PlanError(
            f"an FSDP2-sharded dense part shards over all {world_size} ranks; with replicated expert groups "
            f"(EP degree {ep_degree}) keep it replicated"
        )
    return ep_degree, experts, impl, local


def _warn_ineffective(kind: str, ep_degree: int | None, experts_implementation: str | None) -> None:
    """Warn about settings plan 'whole' accepts but cannot act on (fsdp2 refuses them in `_check_fsdp2`)."""
    if ep_degree not in (None, 1):
        warnings.warn(
            f"ep_degree={ep_degree} has no effect under plan {kind!r} (one process holds every expert); "
            "launch with torchrun and plan 'expert_parallel' to split the experts",
            IneffectiveSettingWarning, stacklevel=3,
        )
    if experts_implementation == "torch_a2a":
        warnings.warn(
            f"experts_implementation='torch_a2a' has no effect under plan {kind!r}: there are no other ranks "
            f"to dispatch to, so the default local implementation runs the experts; name 'eager', "
            "'grouped_mm' or 'batched_mm' to choose it",
            IneffectiveSettingWarning, stacklevel=3,
        )
