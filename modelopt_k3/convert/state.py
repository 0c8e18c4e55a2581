"""State files in ``dst``: completion records, the destination checks and the finalize step.

What the converter owns in ``dst`` (and nothing else): ``.modelopt_k3_convert/`` (``job.json``, the job
record naming its shards; ``shards/<file>.json``, one completion record per shard; ``locks/``), the
output shards and index it lists, ``config.json``, ``hf_quant_config.json``, the source's side files,
the completion marker, and its own staging files (``.<name>.<32 hex>.partial``, ``.<name>.tmp-<pid>-<hex>``).
A ``dst`` that holds anything else and no job record of ours is refused without ``--overwrite``;
with it, the conversion writes its files among the others, replacing only files of the names it
writes, and removes only shards that an earlier conversion into ``dst`` recorded as its own
(``superseded`` in the job record): files it never wrote are left as they are.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .. import __version__
from ..checkpoint import INDEX_NAME
from ..checkpoint.serving_rules import refuse_unservable
from ..export.modelopt_format import config_quantization_config, hf_quant_config
from ..export.writer import (
    copy_side_files,
    file_digest,
    is_tmp_name,
    write_configs,
    write_index,
    write_json_atomic,
)
from ..files.paths import is_staging_name, stat_identity
from ..recipe import Recipe
from .jobs import _Plan
from .report import ConvertStats

STATE_DIR = ".modelopt_k3_convert"
COMPLETE_MARKER = ".modelopt_k3_complete"
JOB_FILE = "job.json"
# 2: the output digest is computed from the bytes as they are written (``ShardDigest``), not read back.
# 3: the source's identity (``source.read``: sha256 of every source tensor read; ``source.identity``).
# 4: fp8_pb Linears of a block-FP8 source are the source's bytes (``block_fp8_copy``), no longer requantized:
#    a shard written before is redone, not resumed.
RECORD_VERSION = 4


class ConvertError(ValueError):
    """The output directory or a shard's state refuses the conversion; the message names the file and the fix."""


def _record_path(dst: Path, file: str) -> Path:
    return dst / STATE_DIR / "shards" / f"{file}.json"


def _read_state(path: Path) -> dict | None:
    """One of our JSON state files, or None when absent, unreadable or not what we write (a JSON object)."""
    try:
        if path.is_symlink() or not path.is_file():
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _load_record(dst: Path, file: str, fingerprint: str, *, verify_hash: bool) -> dict | None:
    """The shard's record if it belongs to this job and its output file still matches it."""
    rec = _read_state(_record_path(dst, file))
    if rec is None or rec.get("version") != RECORD_VERSION or rec.get("fingerprint") != fingerprint:
        return None
    out = dst / file
    try:
        if out.is_symlink() or out.stat().st_size != rec["output"]["size"]:  # we only ever rename files in
            return None
    except (FileNotFoundError, KeyError, TypeError):
        return None
    if verify_hash and file_digest(out) != rec["output"]["digest"]:
        return None
    return rec


def source_identity(plan: _Plan, read: dict[str, str]) -> dict[str, list[int] | None]:
    """``stat_identity`` of every source file a shard read from, as the plan took it before reading: what
    says cheaply that it is unchanged."""
    files = sorted({plan.tensors[key].file for key in read})
    return {f: plan.identity[f] if f in plan.identity else stat_identity(plan.src / f) for f in files}


def check_source(plan: _Plan, dst: Path, file: str, rec: dict, *, verify_hash: bool) -> None:
    """Refuse to keep output shard ``file`` when the source it was converted from changed since.

    Every source tensor it read has its sha256 in the record (what the conversion hashed as it
    streamed). ``verify_hash``: all are hashed again and compared; else only those in files whose
    size, times or inode differ from the record (a copied or touched source is hashed; an untouched
    one costs a ``stat``). A header change is caught before this (it changes the job's fingerprint).
    """
    source = rec.get("source") if isinstance(rec.get("source"), dict) else {}
    read, identity = source.get("read"), source.get("identity")
    if not isinstance(read, dict) or not isinstance(identity, dict):
        raise ConvertError(f"{_record_path(dst, file)} records no source identity; pass --overwrite to convert again")
    suspect = {f for f, ident in identity.items() if verify_hash or stat_identity(plan.src / f) != ident}
    for key, digest in read.items():
        info = plan.tensors.get(key)
        if info is None or (info.file in suspect and plan.reader.sha256(key) != digest):
            raise ConvertError(
                f"the source changed since output shard {file} was converted (tensor {key} no longer holds the "
                "bytes it was converted from); a resume would mix old and new bytes: pass --overwrite "
                "(overwrite=True) to convert everything again from the current source, or restore the source"
            )


def _complete_marker(dst: Path) -> dict | None:
    return _read_state(dst / COMPLETE_MARKER)


def _job_record(dst: Path) -> dict | None:
    """``job.json`` when it is one of ours (a fingerprint and the list of shards)."""
    job = _read_state(dst / STATE_DIR / JOB_FILE)
    if job is None or not isinstance(job.get("fingerprint"), str) or not isinstance(job.get("shards"), list):
        return None
    return job


def _state_dirs(dst: Path) -> tuple[Path, ...]:
    return dst / STATE_DIR, dst / STATE_DIR / "shards", dst / STATE_DIR / "locks"


def _refuse_planted_state(dst: Path) -> None:
    """Our state directories are real directories: a symlink (or a file) at one of their names would
    send records and locks somewhere else, the source included. Never ours, so never removed for the user."""
    for path in _state_dirs(dst):
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            what = "a symlink" if path.is_symlink() else "not a directory"
            raise ConvertError(f"{path} is {what}; the converter keeps its state there and never follows or "
                               "replaces what it did not make: remove it, or choose another output directory")


def _only_our_state(dst: Path) -> bool:
    """``dst`` holds nothing but our state directory (e.g. left with its locks before a job record was written)."""
    return all(p.name == STATE_DIR and p.is_dir() and not p.is_symlink() for p in dst.iterdir())


def make_state_dirs(dst: Path) -> None:
    """Create ``dst`` and our state directories, refusing any that something else occupies."""
    dst.mkdir(parents=True, exist_ok=True)
    _refuse_planted_state(dst)
    for path in _state_dirs(dst):
        path.mkdir(exist_ok=True)
    _refuse_planted_state(dst)  # created meanwhile by someone else


def _marker_matches_disk(dst: Path, marker: dict) -> bool:
    """Every shard the marker lists is on disk with the recorded size (sizes only: a no-op stays cheap)."""
    try:
        return all((dst / f).stat().st_size == out["size"] for f, out in marker["shards"].items())
    except (OSError, KeyError, TypeError, AttributeError):
        return False


def _check_dst(dst: Path, plan: _Plan, *, overwrite: bool) -> ConvertStats | None:
    """Refuse a destination this job must not write into; read-only, so every rank may run it.

    Returns the totals when ``dst`` already holds this job's complete output (nothing to do).
    """
    if dst.is_symlink() and not dst.exists():
        raise ConvertError(f"output path {dst} is a symlink to nothing ({os.readlink(dst)}); choose a directory")
    if dst.exists() and not dst.is_dir():
        raise ConvertError(f"output path {dst} exists and is not a directory")
    if not dst.exists():
        return None
    _refuse_planted_state(dst)
    marker = _complete_marker(dst)
    if marker is not None and not overwrite:
        if marker.get("fingerprint") == plan.fingerprint and _marker_matches_disk(dst, marker):
            return ConvertStats.from_dict(marker["stats"])
        if marker.get("fingerprint") != plan.fingerprint:
            raise FileExistsError(
                f"{dst} already holds a complete conversion of another job (source {marker.get('src')}, recipe "
                f"{marker.get('recipe')}); pass overwrite=True (--overwrite) to replace it, or choose another "
                "output directory"
            )
    old = _job_record(dst)
    if marker is None and old is None and not overwrite and not _only_our_state(dst):
        raise FileExistsError(
            f"output directory {dst} is not empty and holds no modelopt_k3 conversion record "
            f"({STATE_DIR}/{JOB_FILE}); pass overwrite=True (--overwrite) to write into it anyway (files the "
            "conversion does not write are left alone), or choose another output directory"
        )
    if old is not None and old.get("fingerprint") != plan.fingerprint and not overwrite:
        raise ConvertError(
            f"{dst} holds a partial conversion of another job (source {old.get('src')}, recipe "
            f"{old.get('recipe')}); pass overwrite=True (--overwrite) to replace it, or choose another output directory"
        )
    return None


def _prepare_dst(dst: Path, plan: _Plan, recipe: Recipe) -> None:
    """Adopt ``dst`` for this job (after ``_check_dst`` and under the rank locks).

    A marker that no longer describes the files (a shard changed since) or that ``overwrite`` replaces
    is removed first, so the directory never claims to be complete while it is rewritten. Only
    idempotent steps, so that independent ranks may all run it.
    """
    make_state_dirs(dst)
    old, marker = _job_record(dst), _complete_marker(dst)
    if marker is not None or (dst / COMPLETE_MARKER).is_symlink():
        (dst / COMPLETE_MARKER).unlink(missing_ok=True)
        (dst / INDEX_NAME).unlink(missing_ok=True)
    # Shards an earlier conversion here wrote and this one does not: finalize removes them (ours to remove).
    earlier = set(old["shards"]) | set(old.get("superseded", [])) if old is not None else set()
    if marker is not None and isinstance(marker.get("shards"), dict):
        earlier |= set(marker["shards"])
    job = {
        "producer": "modelopt_k3",
        "fingerprint": plan.fingerprint,
        "src": str(plan.src),
        "recipe": recipe.name,
        "shards": plan.files,
        "superseded": sorted(f for f in earlier - set(plan.files) if isinstance(f, str) and "/" not in f),
    }
    if old != job:
        write_json_atomic(dst / STATE_DIR / JOB_FILE, job)
    sweep_tmp_files(dst)
    sweep_tmp_files(dst / STATE_DIR / "shards")


def sweep_tmp_files(where: Path) -> list[Path]:
    """Remove the ``write_json_atomic`` temporaries a killed run left in ``where``: those of processes that
    no longer run on this host, or older than the stale limit (another host's). Never trusted by a rerun
    (dot names no reader opens), removed so that they do not pile up."""
    from ..files.locks import _stale_after_s

    removed = []
    now = time.time()
    for path in where.iterdir() if where.is_dir() else ():
        ours, pid = is_tmp_name(path.name)
        if not ours or pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
        try:
            old = now - path.lstat().st_mtime > _stale_after_s()
        except FileNotFoundError:
            continue
        if not alive or old:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _fsync(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _finalize(plan: _Plan, dst: Path, recipe: Recipe) -> ConvertStats:
    """Check every shard's record, then write index, configs, side files and (last) the marker."""
    records = _complete_records(plan, dst)
    for file, rec in records.items():  # shards other processes made: their source still as they read it
        check_source(plan, dst, file, rec, verify_hash=False)
    weight_map = {key: f for f, rec in records.items() for key in rec["tensors"]}
    write_index(dst, [weight_map], sum(rec["tensor_bytes"] for rec in records.values()), rename=False)
    hf_quant = hf_quant_config(
        plan.table.layer_algos(), kv_cache=recipe.kv_cache, unquantized=plan.table.unquantized_modules(),
        recipe=recipe.name, naming=plan.table.naming,
    )
    write_configs(plan.src, dst, config_quantization_config(hf_quant), hf_quant)
    copy_side_files(plan.src, dst)
    _remove_foreign_shards(dst, set(plan.files))
    refuse_unservable(dst, plan.src, str(dst))  # the serving rules its files decide: no marker if one is broken
    # The marker must never be on disk before what it describes: index, configs and side files first.
    _fsync([*(p for p in dst.iterdir() if p.is_file() and not p.name.endswith(".safetensors")), dst])
    total = ConvertStats()
    for rec in records.values():
        total.add(ConvertStats.from_dict(rec["stats"]))
    marker = {
        "producer": {"name": "modelopt_k3", "version": __version__},
        "fingerprint": plan.fingerprint,
        "recipe": recipe.name,
        "src": str(plan.src),
        "shards": {f: rec["output"] for f, rec in records.items()},
        "stats": total.to_dict(),
    }
    write_json_atomic(dst / COMPLETE_MARKER, marker)
    return total


def _complete_records(plan: _Plan, dst: Path) -> dict[str, dict]:
    """Every shard's completion record, or a refusal naming a shard that is not complete."""
    records = {f: _load_record(dst, f, plan.fingerprint, verify_hash=False) for f in plan.files}
    missing = [f for f, rec in records.items() if rec is None]
    if missing:
        raise ConvertError(
            f"cannot finalize {dst}: {len(missing)} of {len(plan.files)} shard(s) are not complete, "
            f"e.g. {missing[0]}; run the ranks that own them (a rerun resumes)"
        )
    return records


def _remove_foreign_shards(dst: Path, keep: set[str]) -> None:
    """Shards an earlier conversion here recorded that are not part of this output, and our staging files
    (every shard is complete now, so no partial is being written). Files we never wrote stay."""
    job = _job_record(dst) or {}
    for name in job.get("superseded", []):
        if name not in keep and (dst / name).is_file():
            (dst / name).unlink(missing_ok=True)
    for path in dst.iterdir():
        if is_staging_name(path.name, kind="partial"):
            path.unlink(missing_ok=True)
