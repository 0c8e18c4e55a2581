"""The run-scoped process group: one object that says who this process is.

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set, world > 1)
``init_run_group`` initialises ``torch.distributed`` (NCCL when CUDA is present, gloo
otherwise); in a plain ``python`` process it returns a single-process group and initialises
nothing, so callers write one code path (see ``collectives.py``, whose wrappers are identity
functions at world size 1).

The timeout (``MODELOPT_K3_DIST_TIMEOUT`` seconds, default 600) bounds every collective:
with gloo a collective whose peer died or hangs raises after at most that long; with NCCL
the watchdog aborts the process after it.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "RunGroup",
    "current_group",
    "destroy_run_group",
    "init_run_group",
    "run_group",
]

TIMEOUT_ENV = "MODELOPT_K3_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0

# torchrun sets all of these; WORLD_SIZE > 1 without the rest is a launch mistake.
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RunGroup:
    """Who this process is in the run. ``pg`` is None for a single-process run."""

    rank: int
    world_size: int
    local_rank: int
    backend: str  # "nccl" | "gloo" | "none" (single process)
    device: torch.device
    pg: dist.ProcessGroup | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_current: RunGroup | None = None
_owned = False  # True when init_run_group created the torch.distributed group (and may destroy it)


def _default_timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


def _device_for(local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def _single_process_group() -> RunGroup:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return RunGroup(0, 1, local_rank, "none", _device_for(local_rank), None)


def _adopt_initialised() -> RunGroup:
    """Describe a torch.distributed default group that someone else initialised."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    backend = str(dist.get_backend())
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return RunGroup(rank, world_size, local_rank, backend, device, dist.group.WORLD)


def init_run_group(timeout_s: float | None = None, *, backend: str | None = None) -> RunGroup:
    """Initialise (once) and return the run's group.

    ``timeout_s`` defaults to ``$MODELOPT_K3_DIST_TIMEOUT`` or 600. ``backend`` overrides the
    choice (nccl if CUDA is available, else gloo). Idempotent: a second call returns the
    current group; a default group initialised elsewhere is adopted, not re-initialised.
    """
    global _current, _owned
    if _current is not None:
        return _current
    if dist.is_available() and dist.is_initialized():
        _current, _owned = _adopt_initialised(), False
        return _current

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        _current, _owned = _single_process_group(), False
        return _current

    missing = [name for name in _TORCHRUN_ENV if not os.environ.get(name)]
    if missing:
        raise ValueError(
            f"WORLD_SIZE={world_size} but {', '.join(missing)} not set; launch with "
            "`torchrun --nproc_per_node N ...` (or set all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
        )
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    timeout = timedelta(seconds=timeout_s if timeout_s is not None else _default_timeout_s())

    kwargs = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # binds the group to this GPU: no device guessing in barrier()
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    _current, _owned = RunGroup(rank, world_size, local_rank, backend, device, dist.group.WORLD), True
    return _current


def current_group() -> RunGroup:
    """The group ``init_run_group`` made; a single-process group if none was made."""
    if _current is not None:
        return _current
    if dist.is_available() and dist.is_initialized():
        return _adopt_initialised()
    return _single_process_group()


def destroy_run_group() -> None:
    """Tear down the group if this module created it; forget it either way."""
    global _current, _owned
    destroyed = _owned and dist.is_initialized()
    if destroyed:
        dist.destroy_process_group()
    _current, _owned = None, False
    if destroyed:
        # Collect now: a gloo ProcessGroup still referenced from a cycle at interpreter exit can abort
        # the process ("terminate called without an active exception") after a successful run. Without a
        # group there is nothing to collect, and a full collection rescans torch (~0.3 s) for nothing.
        gc.collect()


@contextlib.contextmanager
def run_group(timeout_s: float | None = None, *, backend: str | None = None) -> Iterator[RunGroup]:
    """``init_run_group`` for the duration of a block; destroys what it created, even on error."""
    already = _current is not None
    group = init_run_group(timeout_s, backend=backend)
    try:
        yield group
    finally:
        if not already:
            destroy_run_group()
