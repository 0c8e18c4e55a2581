"""The temporary siblings of an export directory, and the removal of those that dead runs left behind.

An export is written into ``.<name>.tmp-<hex>/`` next to ``<name>`` and renamed into place at the
end; replacing an old export first moves it aside to ``.<name>.old-<hex>/``. Each such directory has
an owner record ``<dir>.owner.json`` beside it (``files.locks.Owner``: pid, host, boot id, process
start time; its mtime is the owner's heartbeat), written before the directory is made and removed
after it is gone. A run that ends normally, fails or gets SIGTERM removes its own directory; one
killed outright (``kill -9``, OOM killer, a lost node) cannot, so the next run to the same export
path calls ``sweep_stale`` and removes what dead runs left, saying so. A directory whose owner
may still run, or that has no record, is kept (and named).
"""

from __future__ import annotations

import logging
import re
import shutil
import uuid
from pathlib import Path

from ..files.locks import Heartbeat, Owner, owner_status, read_record, write_record

__all__ = ["OWNER_SUFFIX", "StagingDir", "discard_live", "remove_tree", "sweep_stale"]

log = logging.getLogger("modelopt_k3")
OWNER_SUFFIX = ".owner.json"


def _sibling_re(export_dir: Path) -> re.Pattern:
    return re.compile(rf"^\.{re.escape(export_dir.name)}\.(?P<kind>tmp|old)-[0-9a-f]{{12}}$")


def remove_tree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


# Staging directories this process claimed and has not released: what an interrupted run must remove (or name).
_LIVE: set[StagingDir] = set()


def discard_live() -> list[Path]:
    """Remove this process's unreleased temporary export directories (an interrupted run: SIGTERM, SIGINT, even
    one arriving as rank 0 made its directory, before any ``finally`` owned it); return those still on disk. A
    moved-aside old export is never removed here: it is the user's checkpoint, put back by the next run."""
    for staging in list(_LIVE):
        if staging.kind == "tmp":
            staging.discard()
    return sorted(s.path for s in _LIVE if s.path.exists() or s.path.is_symlink())


class StagingDir:
    """One owned sibling directory ``.<name>.<kind>-<hex>`` of ``export_dir`` (not created yet)."""

    def __init__(self, export_dir: Path, kind: str) -> None:
        self.kind = kind
        self.path = export_dir.parent / f".{export_dir.name}.{kind}-{uuid.uuid4().hex[:12]}"
        self.record = self.path.with_name(self.path.name + OWNER_SUFFIX)
        self._beat: Heartbeat | None = None

    def claim(self) -> StagingDir:
        """Write the owner record (first, so the directory never exists without one) and heartbeat."""
        write_record(self.record, Owner.this_process(), {"kind": "modelopt_k3 export staging"}, exclusive=True)
        _LIVE.add(self)
        self._beat = Heartbeat(self.record).start()
        return self

    def mkdir(self) -> Path:
        """Claim, then create the directory; a failure or a signal in between leaves neither behind."""
        try:
            self.claim()
            self.path.mkdir()
        except BaseException:
            self.discard()
            raise
        return self.path

    def release(self) -> None:
        """Drop the record once the directory is gone or renamed away."""
        if self._beat is not None:
            self._beat.stop()
        self.record.unlink(missing_ok=True)
        _LIVE.discard(self)

    def discard(self) -> None:
        remove_tree(self.path)
        self.release()


def sweep_stale(export_dir: Path) -> list[str]:
    """Remove the temporary siblings of ``export_dir`` whose owners are dead; one message per sibling.

    A dead run's moved-aside old export is put back when ``export_dir`` is missing (the run died
    between moving it aside and renaming the new one in), else removed.
    """
    export_dir = Path(export_dir).absolute()
    parent = export_dir.parent
    if not parent.is_dir():
        return []
    pattern = _sibling_re(export_dir)
    bases: set[str] = set()
    for entry in parent.iterdir():
        name = entry.name.removesuffix(OWNER_SUFFIX)
        if pattern.match(name):
            bases.add(name)
    notes = []
    for name in sorted(bases):
        path = parent / name
        record = path.with_name(name + OWNER_SUFFIX)
        found = read_record(record)
        if found is None:
            if path.exists():
                notes.append(f"kept {path}: it has no owner record, so whether a run still writes it is unknown; "
                             "remove it yourself if none does")
            continue
        owner, _ = found
        alive, why = owner_status(owner, record)
        if alive:
            if path.exists():
                notes.append(f"kept {path}: its run may still be writing it ({owner.describe()}; {why})")
            continue
        if not path.exists():
            record.unlink(missing_ok=True)
            continue
        if pattern.match(name)["kind"] == "old" and not export_dir.exists() and not export_dir.is_symlink():
            path.rename(export_dir)
            notes.append(f"restored {export_dir} from {path}: the run replacing it died ({owner.describe()}; {why})")
        else:
            remove_tree(path)
            notes.append(f"removed {path} left by a dead run ({owner.describe()}; {why})")
        record.unlink(missing_ok=True)
    for note in notes:
        log.warning("modelopt_k3: %s", note)
    return notes
