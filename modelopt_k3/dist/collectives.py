"""Collectives that fail together and never hang.

``run_together(step, fn)`` runs ``fn`` on every rank, then the ranks agree on the outcome:
an all_reduce(MAX) of a failure flag, and only if someone failed an all_gather_object of the
error strings. If any rank failed, every rank raises ``DistributedStepError`` naming the step
and each failing rank's exception, so no rank walks on into a collective its peers will never
join.

A rank that dies outright (killed, ``os._exit``) cannot report. Its peers' agreement
collective then fails: with gloo it raises as soon as the connection drops, or at the latest
after the process-group timeout (``MODELOPT_K3_DIST_TIMEOUT``); that error is turned into a
``DistributedStepError`` too. With NCCL the watchdog aborts the process after the timeout.
The same holds for a rank that hangs inside ``fn``.

The thin wrappers below are identity functions at world size 1, so callers write one path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from modelopt_k3.dist.group import RunGroup, current_group

__all__ = [
    "DistributedStepError",
    "all_gather_object",
    "all_reduce_max_",
    "barrier",
    "broadcast_object",
    "run_together",
]

T = TypeVar("T")

_MAX_ERROR_CHARS = 2000  # per rank; keeps the gathered report small when an error message is huge


class DistributedStepError(RuntimeError):
    """A step failed on at least one rank; raised on every rank.

    ``failures`` maps failing rank -> "ExceptionType: message". It is empty when the ranks
    could not even agree (a peer died or timed out); ``note`` then says so.
    """

    def __init__(self, step: str, failures: dict[int, str], *, rank: int, note: str | None = None):
        self.step = step
        self.failures = dict(sorted(failures.items()))
        self.rank = rank
        self.note = note
        super().__init__(self._message())

    def _message(self) -> str:
        where = f"(seen from rank {self.rank})"
        if not self.failures:
            return f"step {self.step!r} failed {where}: {self.note}"
        ranks = ", ".join(str(r) for r in self.failures)
        noun = "rank" if len(self.failures) == 1 else "ranks"
        details = "; ".join(f"rank {r}: {msg}" for r, msg in self.failures.items())
        text = f"step {self.step!r} failed on {noun} {ranks} {where}: {details}"
        return f"{text} ({self.note})" if self.note else text

    def __reduce__(self):  # picklable despite the keyword-only constructor
        return (_rebuild_step_error, (self.step, self.failures, self.rank, self.note))


def _rebuild_step_error(step, failures, rank, note):
    return DistributedStepError(step, failures, rank=rank, note=note)


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "...[truncated]"


def _pg(group: RunGroup | None) -> RunGroup:
    return group if group is not None else current_group()


def run_together(
    step_name: str, fn: Callable[..., T], *args: Any, group: RunGroup | None = None, **kwargs: Any
) -> T:
    """Run ``fn(*args, **kwargs)`` on this rank; raise on every rank if it raised on any.

    Returns this rank's result. At world size 1 the original exception propagates unchanged
    (there is nobody to tell). Otherwise the failing rank's ``DistributedStepError`` chains
    its original exception. Only ``Exception`` is caught: KeyboardInterrupt/SystemExit leave
    at once and the peers fail when the timeout runs out.
    """
    g = _pg(group)
    if g.world_size == 1:
        return fn(*args, **kwargs)

    result: Any = None
    local_error: Exception | None = None
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:
        local_error = exc

    try:
        flag = torch.tensor([0 if local_error is None else 1], dtype=torch.int32, device=g.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=g.pg)
        anyone_failed = bool(flag.item())
        reports: list[str | None] = [None] * g.world_size
        if anyone_failed:
            mine = None if local_error is None else _describe(local_error)
            dist.all_gather_object(reports, mine, group=g.pg)
    except Exception as comm_exc:
        failures = {g.rank: _describe(local_error)} if local_error is not None else {}
        note = (
            "could not agree with the other ranks, a rank probably died or hung past the "
            f"process-group timeout: {_describe(comm_exc)}"
        )
        raise DistributedStepError(step_name, failures, rank=g.rank, note=note) from (local_error or comm_exc)

    if anyone_failed:
        failures = {r: msg for r, msg in enumerate(reports) if msg is not None}
        raise DistributedStepError(step_name, failures, rank=g.rank) from local_error
    return result


def all_reduce_max_(tensor: torch.Tensor, group: RunGroup | None = None) -> torch.Tensor:
    """In-place element-wise max over ranks; returns ``tensor``. No-op at world size 1.

    With NCCL the tensor must live on ``group.device``.
    """
    g = _pg(group)
    if g.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=g.pg)
    return tensor


def all_gather_object(obj: Any, group: RunGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, indexed by rank (``[obj]`` at world size 1). Pickled: keep it small."""
    g = _pg(group)
    if g.world_size == 1:
        return [obj]
    out: list[Any] = [None] * g.world_size
    dist.all_gather_object(out, obj, group=g.pg)
    return out


def broadcast_object(obj: Any, src: int = 0, group: RunGroup | None = None, *, step: str | None = None) -> Any:
    """``obj`` from rank ``src`` on every rank (other ranks' ``obj`` is ignored). ``step``: a communication
    failure (a peer died) is that step's ``DistributedStepError``, a one-line refusal, not the backend's."""
    g = _pg(group)
    if g.world_size == 1:
        return obj
    box = [obj if g.rank == src else None]
    try:
        dist.broadcast_object_list(box, src=src, group=g.pg)
    except Exception as comm_exc:
        if step is None:
            raise
        raise DistributedStepError(step, {}, rank=g.rank, note=(
            f"rank {src} could not send it, a rank probably died or hung past the process-group timeout: "
            f"{_describe(comm_exc)}")) from comm_exc
    return box[0]


def barrier(group: RunGroup | None = None) -> None:
    """Wait for every rank. No-op at world size 1."""
    g = _pg(group)
    if g.world_size > 1:
        dist.barrier(group=g.pg)
