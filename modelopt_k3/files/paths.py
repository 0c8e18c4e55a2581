"""Destination checks shared by ``hf_ptq`` and the converter: never write over the source, find an
unwritable destination before the run instead of after it, and create files only where nothing was
planted.

Every file the tools write goes first to a new name nobody can predict (``staging_path``: 128 random
bits), created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (``create_new``): a file or symlink planted at
that name makes the create fail instead of being opened, truncated or followed. It is then renamed
over its final name; ``rename`` replaces a symlink there rather than writing through it.
"""

from __future__ import annotations

import os
import re
import tempfile
import uuid
from pathlib import Path

__all__ = ["OWNED_RECORD", "DestinationError", "check_owned_dir", "check_writable", "create_new", "is_checkpoint_dir",
           "replace_file",
           "refuse_overlap", "staging_path", "write_new", "write_owned"]

# Mode of every file the tools write, before the umask (as any tool creating a file): 0644 under umask 022.
FILE_MODE = 0o666
_STAGING_RE = re.compile(r"^\..+\.[0-9a-f]{32}\.(?P<kind>[a-z]+)$")


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


def staging_path(final: Path, kind: str = "partial") -> Path:
    """A fresh name next to ``final`` that a planted file cannot anticipate: ``.<name>.<32 hex>.<kind>``."""
    return final.with_name(f".{final.name}.{uuid.uuid4().hex}.{kind}")


def is_staging_name(name: str, final: str | None = None, kind: str | None = None) -> bool:
    """Whether ``name`` is one of ``staging_path``'s (for ``final``, of ``kind``, when given)."""
    m = _STAGING_RE.match(name)
    return bool(m) and (final is None or name.startswith(f".{final}.") and len(name) == len(final) + 35 + len(m["kind"])) \
        and (kind is None or m["kind"] == kind)


def create_new(path: Path, mode: int = FILE_MODE) -> int:
    """A write descriptor of a file created at ``path`` now: never one that exists, nor a symlink's target."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags, mode)


def write_new(path: Path, data: bytes) -> None:
    """Write ``data`` to a file created at ``path`` (``create_new``); removed again if writing fails."""
    fd = create_new(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def output_mode() -> int:
    """The mode a file created now gets (``FILE_MODE`` less the umask): what ``fix_mode`` gives the files
    written by a library that picks its own (safetensors' ``save_file`` writes 0600)."""
    return FILE_MODE & ~_umask()


def _umask() -> int:
    try:  # Linux says it without changing it (os.umask would, for every thread, for a moment)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fix_mode(path: Path) -> None:
    os.chmod(path, output_mode())


# ----------------------------------------------------------------- files written into a directory we own

# The record of what the tools wrote into a directory that is not a checkpoint staging directory (a report):
# name -> sha256 of the bytes written. A file there is replaced only while it still holds what we wrote.
OWNED_RECORD = ".modelopt_k3_files.json"


def stat_identity(path: Path) -> list[int] | None:
    """(size, mtime, ctime in ns, inode): any write to the file changes its ctime, which no one can set back;
    so an unchanged identity means unchanged bytes, and a changed one means "hash again", not "changed"."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def is_checkpoint_dir(path: Path) -> bool:
    """A checkpoint directory: ``config.json`` and safetensors shards (nothing of ours is written into one)."""
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _digest(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _read_nofollow(path: Path, limit: int = 2**26) -> bytes | None:
    """The bytes of regular file ``path`` (None when absent); never through a symlink, never a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None
    try:
        import stat

        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        chunks, total = [], 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise OSError(f"{path} is larger than {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _owned_record(out_dir: Path, flag: str) -> dict[str, str]:
    record = out_dir / OWNED_RECORD
    if record.is_symlink():
        raise DestinationError(f"{flag} {out_dir}: {record} is a symlink; it is never followed: remove it")
    try:
        raw = _read_nofollow(record)
    except OSError as e:
        raise DestinationError(f"{flag} {out_dir}: {record} cannot be read ({e}); remove it") from None
    if raw is None:
        return {}
    import json

    try:
        files = json.loads(raw)["files"]
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise DestinationError(f"{flag} {out_dir}: {record} is not a record this tool wrote; remove it") from None
    return files


def check_owned_dir(out_dir: Path, names: list[str] | tuple[str, ...], *, flag: str) -> dict[str, str]:
    """Refuse writing ``names`` into ``out_dir`` unless every one is new or still holds what we recorded writing
    there: ``out_dir`` a directory (or creatable) that is no checkpoint, no name a symlink or another file. Returns
    the record (name -> sha256). Read-only: the preflight calls it, and ``write_owned`` again before writing."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise DestinationError(f"{flag} {out_dir} exists and is not a directory; choose a directory path")
    if not out_dir.exists():
        if out_dir.is_symlink():
            raise DestinationError(f"{flag} {out_dir} is a dangling symlink; choose another directory")
        where = _nearest_existing(out_dir.parent)
        if not where.is_dir():
            raise DestinationError(f"{flag} {out_dir} cannot be created: {where} is not a directory")
        return {}
    if is_checkpoint_dir(out_dir):
        raise DestinationError(f"{flag} {out_dir} is a checkpoint directory (config.json and safetensors shards); "
                               "nothing is written into a checkpoint: choose another directory")
    record = _owned_record(out_dir, flag)
    for name in names:
        path = out_dir / name
        if path.is_symlink():
            raise DestinationError(f"{flag} {out_dir}: {path} is a symlink; it is never written through or "
                                   "replaced: remove it, or choose another directory")
        if name == OWNED_RECORD or not path.exists():
            continue
        try:
            held = _read_nofollow(path)
        except OSError as e:
            raise DestinationError(f"{flag} {out_dir}: {path} is not a file this tool wrote ({e})") from None
        if record.get(name) != _digest(held or b""):
            raise DestinationError(f"{flag} {out_dir}: {path} exists and is not what this tool wrote there (not in "
                                   f"{OWNED_RECORD}, or changed since); it is never overwritten: move it, or choose "
                                   "another directory")
    return record


def write_owned(out_dir: Path, files: dict[str, bytes], *, flag: str) -> list[Path]:
    """Write ``files`` (name -> bytes) into ``out_dir``, each created new under a fresh name (``create_new``) and
    renamed over its final name (a rename replaces a link there, never writes through it), after
    ``check_owned_dir``; then record them (``OWNED_RECORD``), so a later run may replace them."""
    out_dir = Path(out_dir)
    names = [*files, OWNED_RECORD]
    check_owned_dir(out_dir, names, flag=flag)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = check_owned_dir(out_dir, names, flag=flag)  # again: the directory may have existed meanwhile
    written = []
    for name, data in files.items():
        _replace_new(out_dir / name, data)
        record[name] = _digest(data)
        written.append(out_dir / name)
    import json

    _replace_new(out_dir / OWNED_RECORD, (json.dumps({"files": record}, indent=1, sort_keys=True) + "\n").encode())
    return written


def replace_file(path: Path, data: bytes, *, flag: str) -> None:
    """Replace the one file ``path`` (a file of the project's own, e.g. a tracked report) with ``data``: created new
    under a fresh name and renamed over it, never written through a link; refused when ``path`` is a symlink or
    a directory, or lies in a checkpoint directory."""
    path = Path(path)
    if path.is_symlink():
        raise DestinationError(f"{flag} {path} is a symlink; it is never written through or replaced: remove it")
    if path.is_dir():
        raise DestinationError(f"{flag} {path} is a directory; a file is written there")
    if path.parent.is_dir() and is_checkpoint_dir(path.parent):
        raise DestinationError(f"{flag} {path.parent} is a checkpoint directory; nothing is written into a checkpoint")
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace_new(path, data)


def _replace_new(final: Path, data: bytes) -> None:
    tmp = staging_path(final, "new")
    write_new(tmp, data)
    try:
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
