"""Every lock the tools hold, and who owns a temporary directory or a lock and whether that owner still runs.

The locks, all owner records created whole and held with a heartbeat (``FileLock``):

* ``acquire_lock``: one lock file, refused (``LockHeld``) while a live owner holds it;
* ``acquire_export_lock``: ``hf_ptq``'s export path, ``.<name>.lock`` beside it, held by rank 0 from the
  preflight to the end of the run, so two runs to one path cannot both pass the preflight;
* ``acquire_rank_lock``: the converter's output, one lock file per rank (``locks/rank-<r>.json`` in its
  state directory, with the job fingerprint and world size), so the ranks of one job (torchrun, or
  independent processes on hosts sharing ``dst``) write disjoint shards and a second job is refused.

A run that leaves data behind it (a temporary export directory, a converter's per-rank lock) writes
an owner record next to it: pid, host, the host's boot id and the process's start time, the time it
was made. A later run decides from the record whether the owner is dead:

* same host (hostname and boot id match): the pid is gone, or now belongs to a process that started
  at another time (pid reuse); a record from an earlier boot of this host is dead;
* another host: no heartbeat for ``stale_after_s`` (the live owner touches its record every
  ``HEARTBEAT_S``); ranks of one job may run on several hosts sharing the filesystem.

Anything that cannot be decided counts as alive: data of a live run is never removed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "HEARTBEAT_S",
    "RANK_LOCK_DIR",
    "FileLock",
    "LockHeld",
    "acquire_export_lock",
    "acquire_lock",
    "acquire_rank_lock",
    "export_lock_path",
    "live_locks",
    "STALE_AFTER_ENV",
    "Heartbeat",
    "Owner",
    "owner_status",
    "read_record",
    "write_record",
]

HEARTBEAT_S = 30.0
STALE_AFTER_ENV = "MODELOPT_K3_STALE_AFTER_S"
DEFAULT_STALE_AFTER_S = 600.0


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # fields after "pid (comm)" start at field 3


@dataclass(frozen=True)
class Owner:
    pid: int
    host: str
    boot_id: str | None
    start_ticks: str | None
    created: float

    @classmethod
    def this_process(cls) -> Owner:
        pid = os.getpid()
        return cls(pid, socket.gethostname(), _boot_id(), _start_ticks(pid), time.time())

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.created))
        return f"pid {self.pid} on {self.host}, started {when}"


def write_record(path: Path, owner: Owner, extra: dict | None = None, *, exclusive: bool = False) -> None:
    """Write ``path`` = the owner record (plus ``extra``), whole: written to a fresh name first, then
    renamed (or, ``exclusive``: hard-linked, which fails if ``path`` exists: a lock). So a record on disk
    is never half-written, and an empty or unreadable one was never a live run's."""
    from .paths import staging_path, write_new

    body = (json.dumps({**asdict(owner), **(extra or {})}, indent=2) + "\n").encode()
    tmp = staging_path(path, "new")
    write_new(tmp, body)
    try:
        if not exclusive:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)
        except OSError as e:
            if isinstance(e, FileExistsError) or e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            _write_exclusive(path, body)  # a filesystem without hard links: O_EXCL, then the body
    finally:
        tmp.unlink(missing_ok=True)


def _write_exclusive(path: Path, body: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        os.write(fd, body)
    finally:
        os.close(fd)


def read_record(path: Path) -> tuple[Owner, dict] | None:
    """The owner and the whole record, or None when absent or unreadable (e.g. written half-way)."""
    try:
        data = json.loads(path.read_text())
        owner = Owner(int(data["pid"]), str(data["host"]), data.get("boot_id"), data.get("start_ticks"),
                      float(data["created"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return owner, data


def _stale_after_s() -> float:
    raw = os.environ.get(STALE_AFTER_ENV, "").strip()
    return float(raw) if raw else DEFAULT_STALE_AFTER_S


def owner_status(owner: Owner, record: Path) -> tuple[bool, str]:
    """(alive, why). Undecidable counts as alive."""
    me = Owner.this_process()
    if owner.host == me.host and owner.boot_id == me.boot_id:
        if owner.pid == me.pid and owner.start_ticks == me.start_ticks:
            return True, "this process"
        try:
            os.kill(owner.pid, 0)
        except ProcessLookupError:
            return False, f"pid {owner.pid} no longer runs on {owner.host}"
        except PermissionError:
            pass  # exists, owned by another user
        ticks = _start_ticks(owner.pid)
        if owner.start_ticks is not None and ticks is not None and ticks != owner.start_ticks:
            return False, f"pid {owner.pid} on {owner.host} now belongs to another process"
        return True, f"pid {owner.pid} still runs on {owner.host}"
    if owner.host == me.host and owner.boot_id is not None and me.boot_id is not None:
        return False, f"{owner.host} has rebooted since"
    try:
        age = time.time() - record.stat().st_mtime
    except FileNotFoundError:
        return False, "its record is gone"
    stale = _stale_after_s()
    if age > stale:
        return False, f"no heartbeat from {owner.host} for {age:.0f} s (> {stale:.0f} s, ${STALE_AFTER_ENV})"
    return True, f"{owner.host} is another host and its heartbeat is {age:.0f} s old"


class Heartbeat:
    """Touch ``path`` every ``interval_s`` from a daemon thread, so other hosts can tell we are alive."""

    def __init__(self, path: Path, interval_s: float = HEARTBEAT_S) -> None:
        self.path = path
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="modelopt-k3-heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                os.utime(self.path)
            except OSError:  # removed (run finished or cleaned up): nothing left to keep alive
                return

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


@contextlib.contextmanager
def heartbeat(path: Path, interval_s: float = HEARTBEAT_S) -> Iterator[Heartbeat]:
    beat = Heartbeat(path, interval_s).start()
    try:
        yield beat
    finally:
        beat.stop()


class LockHeld(ValueError):
    """A live run holds the lock; the message names it (pid, host, start time) and what to do."""


@dataclass
class FileLock:
    """A held lock file (an owner record, heartbeat running); ``release`` removes it. Idempotent."""

    path: Path
    beat: Heartbeat

    def release(self) -> None:
        self.beat.stop()
        self.path.unlink(missing_ok=True)


def acquire_lock(path: Path, extra: dict | None = None, notes: list[str] | None = None) -> FileLock:
    """Take lock file ``path`` (an owner record created whole, ``write_record(exclusive=True)``), or raise
    ``LockHeld`` naming the live holder. A lock of a dead owner, and an empty or unreadable one (never a live
    run's: records are linked in whole), is removed first, with a note saying so."""
    for _ in range(3):
        try:
            write_record(path, Owner.this_process(), extra, exclusive=True)
        except FileExistsError:
            pass
        else:
            return FileLock(path, Heartbeat(path).start())
        found = read_record(path)
        if found is None:
            note = f"removed the lock file {path}: it is empty or unreadable, so no live run holds it (a crash left it)"
        else:
            owner, _ = found
            alive, why = owner_status(owner, path)
            if alive:
                raise LockHeld(f"{path} is held by another run ({owner.describe()}; {why}); wait for it to end, "
                               "or remove the file if that run is dead")
            note = f"removed the stale lock {path} ({owner.describe()}; {why})"
        path.unlink(missing_ok=True)
        if notes is not None:
            notes.append(note)
    raise LockHeld(f"{path} reappears each time it is removed: another run is taking it; try again later")


# --- the export path's lock (hf_ptq) ----------------------------------------------------------------------


def export_lock_path(export_path: Path) -> Path:
    """The lock file of an export path: ``.<name>.lock`` beside it."""
    return export_path.parent / f".{export_path.name}.lock"


def acquire_export_lock(export_path: Path, cleanup: list[Callable[[], None]], notes: list[str]) -> None:
    """Hold ``export_lock_path(export_path)`` or raise ``LockHeld``. What undoes it goes on ``cleanup`` (undone
    last first): the release, and the removal of the parent directories it had to create, when still empty
    (that one also when the lock is refused)."""
    lock_path = export_lock_path(export_path.absolute())
    made = [p for p in (lock_path.parent, *lock_path.parent.parents) if not p.exists()][::-1]
    lock_path.parent.mkdir(parents=True, exist_ok=True)

    def remove_made() -> None:
        for p in reversed(made):
            try:
                p.rmdir()
            except OSError:
                break

    cleanup.append(remove_made)
    cleanup.append(acquire_lock(lock_path, {"kind": "modelopt_k3 export lock"}, notes).release)


# --- the converter's per-rank locks -----------------------------------------------------------------------
#
# Each rank of a conversion holds ``<state dir>/locks/rank-<r>.json`` (an owner record plus its job
# fingerprint and world size, created exclusively; its mtime is the heartbeat). A process is refused, naming
# the holder, when a live lock holds its rank, or belongs to another job (another recipe or source) or
# another world size. Locks of dead owners (``owner_status``) are removed, saying so. A lock is released
# when its run ends, however it ends short of ``kill -9``; that one is found dead by the next run.

RANK_LOCK_DIR = "locks"


def _rank_lock_path(locks: Path, rank: int) -> Path:
    return locks / f"rank-{rank:05d}.json"


def live_locks(locks: Path, notes: list[str] | None = None) -> list[tuple[Path, Owner, dict, str]]:
    """The live rank locks in ``locks`` (path, owner, record, why alive); dead ones are removed (noted)."""
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


def _rank_conflict(dst: Path, rank: int, world_size: int, fingerprint: str, locks: Path) -> str | None:
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
    dst: Path, locks: Path, *, rank: int, world_size: int, fingerprint: str, notes: list[str]
) -> FileLock:
    """Take rank ``rank``'s lock in ``locks`` (the lock directory of output ``dst``), or raise ``LockHeld``
    naming who holds the destination. Dead owners' locks are cleared first (noted)."""
    live_locks(locks, notes)
    problem = _rank_conflict(dst, rank, world_size, fingerprint, locks)
    if problem is None:
        path = _rank_lock_path(locks, rank)
        extra = {"rank": rank, "world_size": world_size, "fingerprint": fingerprint}
        try:
            write_record(path, Owner.this_process(), extra, exclusive=True)
        except FileExistsError:  # another process took it between the check and now
            problem = _rank_conflict(dst, rank, world_size, fingerprint, locks) or f"{path} appeared meanwhile"
        else:
            return FileLock(path, Heartbeat(path).start())
    raise LockHeld(problem)
