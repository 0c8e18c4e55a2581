"""State files in ``dst``: completion records, the destination checks and the finalize step."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import __version__
from ..checkpoint import INDEX_NAME
from ..export.modelopt_format import config_quantization_config, hf_quant_config
from ..export.writer import copy_side_files, file_digest, write_configs, write_index, write_json_atomic
from ..recipe import Recipe
from .jobs import _Plan
from .report import ConvertStats

STATE_DIR = ".modelopt_k3_convert"
COMPLETE_MARKER = ".modelopt_k3_complete"
JOB_FILE = "job.json"
# 2: the output digest is computed from the bytes as they are written (``ShardDigest``), not read back.
RECORD_VERSION = 2


class ConvertError(ValueError):
    """The output directory or a shard's state refuses the conversion; the message names the file and the fix."""


def _record_path(dst: Path, file: str) -> Path:
    return dst / STATE_DIR / "shards" / f"{file}.json"


def _load_record(dst: Path, file: str, fingerprint: str, *, verify_hash: bool) -> dict | None:
    """The shard's record if it belongs to this job and its output file still matches it."""
    path = _record_path(dst, file)
    try:
        rec = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if rec.get("version") != RECORD_VERSION or rec.get("fingerprint") != fingerprint:
        return None
    out = dst / file
    try:
        if out.stat().st_size != rec["output"]["size"]:
            return None
    except FileNotFoundError:
        return None
    if verify_hash and file_digest(out) != rec["output"]["digest"]:
        return None
    return rec


def _complete_marker(dst: Path) -> dict | None:
    try:
        return json.loads((dst / COMPLETE_MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


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
    if dst.exists() and not dst.is_dir():
        raise ConvertError(f"output path {dst} exists and is not a directory")
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
    state = dst / STATE_DIR
    if marker is None and dst.is_dir() and not state.is_dir() and any(dst.iterdir()) and not overwrite:
        raise FileExistsError(
            f"output directory {dst} is not empty and holds no modelopt_k3 conversion; pass overwrite=True "
            "(--overwrite) to write into it anyway, or choose another output directory"
        )
    try:
        old = json.loads((state / JOB_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        old = None
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
    state = dst / STATE_DIR
    if (dst / COMPLETE_MARKER).exists():
        (dst / COMPLETE_MARKER).unlink(missing_ok=True)
        (dst / INDEX_NAME).unlink(missing_ok=True)
    (state / "shards").mkdir(parents=True, exist_ok=True)
    job = {
        "fingerprint": plan.fingerprint,
        "src": str(plan.src),
        "recipe": recipe.name,
        "shards": plan.files,
    }
    job_path = state / JOB_FILE
    try:
        old = json.loads(job_path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        old = None
    if old != job:
        write_json_atomic(job_path, job)


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
    weight_map = {key: f for f, rec in records.items() for key in rec["tensors"]}
    write_index(dst, [weight_map], sum(rec["tensor_bytes"] for rec in records.values()), rename=False)
    hf_quant = hf_quant_config(
        plan.table.layer_algos(), kv_cache=recipe.kv_cache, unquantized=plan.table.unquantized_modules(),
        recipe=recipe.name, naming=plan.table.naming,
    )
    write_configs(plan.src, dst, config_quantization_config(hf_quant), hf_quant)
    copy_side_files(plan.src, dst)
    _remove_foreign_shards(dst, set(plan.files))
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
    """Shards of an earlier job that are not part of this output (another source's file names), and partials."""
    for path in dst.glob("*.safetensors"):
        if path.name not in keep:
            path.unlink(missing_ok=True)
    for path in dst.glob(".*.safetensors.partial"):
        path.unlink(missing_ok=True)
