"""Ownership of a conversion's output directory: one lock file per rank, one run per destination.

The ranks of one job (torchrun, or independent processes with ``--rank r --world_size W`` on any hosts
that share ``dst``) write disjoint shards of one output, so each holds ``.modelopt_k3_convert/locks/
rank-<r>.json`` (an ``ownership`` record plus its job fingerprint and world size, created with
``O_EXCL``; its mtime is the heartbeat). A process is refused, naming the holder, when a live lock
holds its rank, or belongs to another job (another recipe or source) or another world size. Locks of
dead owners (``ownership.owner_status``) are removed, saying so. A lock is released when its run ends,
however it ends short of ``kill -9``; that one is found dead by the next run.
"""

from __future__ import annotations

from pathlib import Path

from ..ownership import FileLock, Heartbeat, Owner, owner_status, read_record, write_record

__all__ = ["LOCK_DIR", "RankLock", "acquire_rank_lock", "live_locks"]

LOCK_DIR = "locks"


RankLock = FileLock  # a rank's lock file is a held lock file like any other (ownership.FileLock)


def _lock_path(locks: Path, rank: int) -> Path:
    return locks / f"rank-{rank:05d}.json"


def live_locks(locks: Path, notes: list[str] | None = None) -> list[tuple[Path, Owner, dict, str]]:
    """The live locks in ``locks`` (path, owner, record, why alive); dead ones are removed (noted)."""
    live = []
    for path in sorted(locks.glob("rank-*.json")) if locks.is_dir() else ():
        found = read_record(path)
        if found is None:
            # A lock is created whole (``write_record``: written aside, then linked in), so one that is
            # empty or unreadable was never a live run's: a crash or a full disk left it.
            if path.exists():
                path.unlink(missing_ok=True)
                if notes is not None:
                    notes.append(f"removed the lock file {path}: it is empty or unreadable, so no live run holds it "
                                 "(a crash or a full disk left it)")
            continue
        owner, record = found
        alive, why = owner_status(owner, path)
        if alive:
            live.append((path, owner, record, why))
        else:
            path.unlink(missing_ok=True)
            if notes is not None:
                notes.append(f"removed the stale lock of rank {record.get('rank')} ({owner.describe()}; {why})")
    return live


def _conflict(dst: Path, rank: int, world_size: int, fingerprint: str, locks: Path) -> str | None:
    for path, owner, record, why in live_locks(locks):
        held = f"{owner.describe()}, rank {record.get('rank')} of {record.get('world_size')}; {why}"
        if record.get("fingerprint") != fingerprint or record.get("world_size") != world_size:
            return (f"{dst} is being written by another conversion ({held}; another recipe, source or world "
                    f"size); wait for it to end, or remove {path} if that run is dead")
        if record.get("rank") == rank:
            return (f"rank {rank} of {dst} is already being converted ({held}); wait for it to end, "
                    f"or remove {path} if that run is dead")
    return None


def acquire_rank_lock(
    dst: Path, state_dir: Path, *, rank: int, world_size: int, fingerprint: str, notes: list[str]
) -> RankLock:
    """Take this rank's lock on ``dst`` or raise ``ConvertError`` naming who holds the destination."""
    from .state import ConvertError, make_state_dirs

    locks = state_dir / LOCK_DIR
    make_state_dirs(dst)  # refuses a symlink or a file planted where our state directories go
    live_locks(locks, notes)  # clear dead owners' locks first (noted)
    problem = _conflict(dst, rank, world_size, fingerprint, locks)
    if problem is None:
        path = _lock_path(locks, rank)
        extra = {"rank": rank, "world_size": world_size, "fingerprint": fingerprint}
        try:
            write_record(path, Owner.this_process(), extra, exclusive=True)
        except FileExistsError:  # another process took it between the check and now
            problem = _conflict(dst, rank, world_size, fingerprint, locks) or f"{path} appeared meanwhile"
        else:
            return RankLock(path, Heartbeat(path).start())
    raise ConvertError(problem)
