"""Destination checks shared by ``hf_ptq`` and the converter: never write over the source, and find an
unwritable destination before the run instead of after it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["DestinationError", "check_writable", "refuse_overlap"]


class DestinationError(ValueError):
    """The output path would damage the source, or cannot be written; the message says what to do."""


def refuse_overlap(source: Path, dest: Path, *, flag: str = "--export_path") -> None:
    """Refuse a ``dest`` that is ``source``, lies inside it, or contains it (symlinks resolved).

    Writing an export replaces ``dest`` as a whole (and stages next to it), so any overlap would
    overwrite or remove part of the source checkpoint.
    """
    src, dst = Path(source).resolve(), Path(dest).resolve()
    if dst == src:
        why = "is the source checkpoint"
    elif src.is_relative_to(dst):
        why = "contains the source checkpoint (replacing it would delete the source)"
    elif dst.is_relative_to(src):
        why = "lies inside the source checkpoint"
    else:
        return
    shown = f"{dest} (= {dst})" if Path(dest).absolute() != dst else str(dst)
    raise DestinationError(f"{flag} {shown} {why} {src}; choose an output directory outside it")


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            return candidate
    return Path(path.anchor)


def check_writable(dest: Path, *, flag: str = "--export_path", inside: bool = False) -> None:
    """Refuse a ``dest`` that cannot be created and written: probe with a file that is removed again.

    ``inside``: files go into ``dest`` itself (the converter); else next to it (the staging
    directory of an export is a sibling of ``dest``).
    """
    dest = Path(dest).absolute()
    if dest.exists() and not dest.is_dir():
        raise DestinationError(f"{flag} {dest} exists and is not a directory; choose a directory path")
    where = _nearest_existing(dest if inside else dest.parent)
    if not where.is_dir():
        raise DestinationError(f"{flag} {dest} cannot be created: {where} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".modelopt_k3-write-probe-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise DestinationError(
            f"{flag} {dest} is not writable ({where}: {e.strerror or e}); choose a writable location"
        ) from None
