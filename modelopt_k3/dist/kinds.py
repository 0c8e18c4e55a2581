"""The distribution plan's vocabulary: plan kinds, dense sharding modes, experts residencies, and which
residency a plan can hold. Pure (no torch), so the CLI builds its choices from it before importing torch."""

from __future__ import annotations

from enum import Enum

# The expert-parallel degree a launcher may set for ``hf_ptq`` (its ``--ep_degree`` default): read by the command
# line once, never by a stage (``decide_plan``'s None is the world size).
EP_DEGREE_ENV = "MODELOPT_K3_EP_DEGREE"


class _StrEnum(str, Enum):
    """A str-valued enum: equal to, formatted and JSON-encoded as its value, so CLI strings, JSON and
    messages stay the same strings (``enum.StrEnum`` is Python 3.11+)."""

    __str__ = str.__str__
    __format__ = str.__format__
    __hash__ = str.__hash__  # a dict keyed by the enum finds the plain string (Enum hashes the member name)

    def __repr__(self) -> str:  # messages quote it with !r, as they quoted the plain string
        return repr(self.value)


class PlanKind(_StrEnum):
    WHOLE = "whole"
    FSDP2 = "fsdp2"
    EXPERT_PARALLEL = "expert_parallel"


class DenseMode(_StrEnum):
    REPLICATED = "replicated"
    FSDP2 = "fsdp2"


class Residency(_StrEnum):
    """How a rank holds its routed experts: decoded ("bf16") or as their MXFP4 source bytes ("packed",
    ``experts/packed.py``)."""

    BF16 = "bf16"
    PACKED = "packed"


AUTO = "auto"  # a request (plan, experts residency) the plan or the memory planner resolves once
PLAN_KINDS: tuple[str, ...] = (AUTO, *PlanKind)
DENSE_MODES: tuple[str, ...] = tuple(DenseMode)
EXPERTS_CHOICES: tuple[str, ...] = (AUTO, *Residency)




def residency_refusal(kind: PlanKind | str, residency: Residency | str, *, packed_source: bool) -> str | None:
    """Why plan ``kind`` cannot hold its experts as ``residency`` (None: it can). The one place this is
    decided: ``DistributionPlan.with_residency`` raises it, the memory planner reports it, and
    ``experts="auto"`` only considers residencies it allows (so auto under fsdp2 is bf16)."""
    if residency not in tuple(Residency):
        return f"unknown experts residency {residency!r}; choose one of {list(EXPERTS_CHOICES)}"
    if residency == Residency.PACKED and not packed_source:
        return ("experts='packed' keeps the experts' MXFP4 source bytes, but the checkpoint stores them decoded; "
                "use experts='bf16' (CLI: --experts bf16)")
    if residency == Residency.PACKED and kind == PlanKind.FSDP2:
        return ("plan 'fsdp2' gathers whole layers of experts on every rank while they run, so packed experts "
                "would decode a whole layer's experts per rank (the BF16 layer they exist to avoid); use "
                "'expert_parallel' with dense='fsdp2' (CLI: --plan expert_parallel --dense fsdp2) for packed "
                "experts with a sharded dense part, or experts='bf16' with plan 'fsdp2'")
    return None


def allowed_residencies(kind: PlanKind | str, *, packed_source: bool) -> tuple[Residency, ...]:
    """The residencies plan ``kind`` can hold, cheapest to run first (what ``experts="auto"`` chooses from)."""
    return tuple(r for r in Residency if residency_refusal(kind, r, packed_source=packed_source) is None)

