"""The placement: which rank holds which routed experts, and the device mesh the ranks are arranged in.

Built once by the distribution plan (``DistributionPlan.build_placement``) and handed on, never
re-derived: the loader reads this rank's experts (``ExpertPlacement.local``), the model spec places
them on the fused experts modules (``ExpertsSpec.place_experts``, which keeps the placement on each
module instance), ``torch_a2a`` routes tokens with ``owner`` and the placement's group, FSDP2 shards
over ``Placement.fsdp_mesh``, and quantize and export name experts with ``global_ids`` and write
them where ``writes_experts`` says.

Mesh axes (``torch.distributed.device_mesh``): ``fsdp`` for the fsdp2 plan; ``replica`` x ``ep`` for
expert parallelism (``world / ep`` copies of an EP group of ``ep`` contiguous ranks); none in one
process.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

from ..spec import SpecError

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

ExpertId = TypeVar("ExpertId")  # an int, or an integer tensor of expert ids

__all__ = ["ExpertPlacement", "Placement", "PlanError", "ResidencyError"]


class PlanError(SpecError):
    """A distribution plan that cannot work, refused before any weight is read (user input: a ValueError)."""


class ResidencyError(PlanError):
    """An experts residency that cannot serve this checkpoint or plan; the message names the fix."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ExpertPlacement:
    """Which contiguous block of every MoE layer's ``num_experts`` routed experts each EP rank holds.

    Rank ``r`` of an EP group of ``ep_size`` holds experts ``[r * per_rank, (r + 1) * per_rank)``.
    ``writes_experts``: whether this rank writes its experts at export (one copy of each expert in the
    output). ``group``: the process group tokens are exchanged in (None: one process, or the world).
    """

    num_experts: int
    ep_size: int = 1
    ep_rank: int = 0
    writes_experts: bool = True
    group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    # The ranks holding these same experts (replicated expert groups: EP degree below the world size), each with
    # its own tokens; None where no other rank holds them.
    replicas: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.ep_size < 1 or self.num_experts % self.ep_size:
            raise PlanError(
                f"num_experts={self.num_experts} is not divisible by the expert-parallel degree {self.ep_size}; "
                f"choose a degree that divides it (one of {_divisors(self.num_experts)})"
            )
        if not 0 <= self.ep_rank < self.ep_size:
            raise PlanError(f"expert-parallel rank {self.ep_rank} is outside the group of {self.ep_size} ranks")

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.ep_size

    def local_range(self, ep_rank: int) -> range:
        """Global ids of the experts EP rank ``ep_rank`` holds."""
        return range(ep_rank * self.per_rank, (ep_rank + 1) * self.per_rank)

    @property
    def local(self) -> range:
        """Global ids of the experts this rank holds."""
        return self.local_range(self.ep_rank)

    def owner(self, expert: ExpertId) -> ExpertId:
        """The EP rank holding global expert ``expert`` (an int or an integer tensor of ids, >= 0)."""
        return expert // self.per_rank

    def global_ids(self, rows: range) -> range:
        """Global ids of rows ``rows`` of this rank's block (all of it, or an FSDP2 shard's rows)."""
        return range(self.local.start + rows.start, self.local.start + rows.stop)

    def with_group(self, group: dist.ProcessGroup | None, replicas: dist.ProcessGroup | None = None
                   ) -> ExpertPlacement:
        return replace(self, group=group, replicas=replicas)


@dataclass(frozen=True)
class Placement:
    """The device mesh of the run (None in one process) and the expert placement on it."""

    experts: ExpertPlacement
    mesh: DeviceMesh | None = None

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The 1-D mesh FSDP2 shards over: ``fsdp`` (plan fsdp2), or ``ep`` for an FSDP2 dense part under
        expert parallelism (the plan requires the EP group to be the world there)."""
        if self.mesh is None or self.mesh.mesh_dim_names is None:
            raise PlanError("FSDP2 needs a multi-rank device mesh; this run has none (one process)")
        names = self.mesh.mesh_dim_names
        return self.mesh["fsdp"] if "fsdp" in names else self.mesh["ep"]
