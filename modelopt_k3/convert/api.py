"""Entry points: ``convert_checkpoint`` (plan, convert this rank's shards, finalize when ready) and
``finalize_conversion``."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ..checkpoint.nonfinite import warn_passthrough
from ..dist.group import RunGroup
from ..files.locks import RANK_LOCK_DIR, FileLock, LockHeld, acquire_rank_lock, live_locks
from ..files.paths import check_writable, refuse_overlap
from ..recipe import Recipe, load_recipe
from .jobs import _Plan
from .plan import _build_plan
from .report import ConvertReport, ConvertStats
from .shard import _finish_shard, _write_shard
from .state import (
    COMPLETE_MARKER,
    JOB_FILE,
    STATE_DIR,
    ConvertError,
    _check_dst,
    _finalize,
    _load_record,
    _prepare_dst,
    _record_path,
    check_source,
    make_state_dirs,
)

log = logging.getLogger("modelopt_k3")

_DENSE_UNCHECKED = ("dense tensors were checked against config.json only (the keys it implies where the model's spec "
                    "declares them, the shapes it fixes): the model was not built, so their dtypes and the shapes "
                    "only the model knows were not checked "
                    "(trust_remote_code / --trust_remote_code builds it on meta and checks each one, as hf_ptq does)")


@dataclass(frozen=True)
class _Options:
    """How this rank converts its shards (``convert_checkpoint``'s keywords)."""

    resume: bool
    overwrite: bool
    verify: bool
    workers: int
    progress: bool
    allow_nonfinite_passthrough: bool


@dataclass(frozen=True)
class _Steps:
    """Runs each step of a conversion: under a process group on every rank together (``run_together``:
    a failure on one rank fails the step on all), else directly. Rank 0 (or a lone process) writes
    the shared state (job file, index, configs, marker)."""

    group: RunGroup | None

    @property
    def writes_state(self) -> bool:
        return self.group is None or self.group.rank == 0

    def __call__(self, step: str, fn: Callable, *args, **kwargs):
        if self.group is None:
            return fn(*args, **kwargs)
        from ..dist.collectives import run_together

        return run_together(f"convert: {step}", fn, *args, group=self.group, **kwargs)

    def by_state_writer(self, step: str, fn: Callable, *args, **kwargs):
        """``fn`` on the rank that writes the shared state; the others only join the step."""
        return self(step, fn if self.writes_state else _nothing, *args, **kwargs)


def _nothing(*args, **kwargs) -> None:
    return None


def _as_recipe(recipe: Recipe | str | Path) -> Recipe:
    return recipe if isinstance(recipe, Recipe) else load_recipe(recipe)


def _process_group(rank: int, world_size: int) -> RunGroup | None:
    """The run group when torch.distributed is initialised for exactly this rank/world, else None."""
    import torch.distributed as dist

    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    from ..dist.group import current_group

    g = current_group()
    if (g.rank, g.world_size) != (rank, world_size):
        raise ValueError(
            f"rank={rank}, world_size={world_size} disagree with the initialised process group "
            f"(rank {g.rank} of {g.world_size}); pass the group's own rank and world size, or leave them out"
        )
    return g


def _options(
    rank: int, world_size: int, *, resume: bool, overwrite: bool, verify: bool, workers: int | None, progress: bool,
    allow_nonfinite_passthrough: bool,
) -> _Options:
    """The keywords checked (errors name the value and the fix); settings that change nothing warn."""
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    workers = min(4, os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if not verify and (not resume or overwrite):
        log.warning("modelopt_k3 convert: verify=False (--no_verify) has no effect: with %s no completed shard is "
                    "kept, so none is verified", "overwrite=True" if overwrite else "resume=False")
    return _Options(resume, overwrite, verify, workers, progress, allow_nonfinite_passthrough)


def _warn_ineffective_recipe_settings(recipe: Recipe) -> None:
    if recipe.calibrate_all_experts:
        log.warning("modelopt_k3 convert: recipe %s sets calibrate_all_experts, which has no effect in the "
                    "calibration-free converter (nothing is calibrated)", recipe.name)


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    recipe: Recipe | str | Path,
    *,
    rank: int = 0,
    world_size: int = 1,
    resume: bool = True,
    overwrite: bool = False,
    verify: bool = True,
    workers: int | None = None,
    progress: bool = False,
    trust_remote_code: bool = False,
    allow_nonfinite_passthrough: bool = False,
) -> ConvertReport:
    """Convert ``src`` into the ModelOpt checkpoint ``dst`` per ``recipe``, shard by shard.

    This rank converts source shards ``i`` with ``i % world_size == rank`` (sorted file names).
    ``resume``: skip shards whose completion record validates (``verify``: also re-hash the output
    file); ``overwrite``: accept an existing complete output, another job's partial output or
    foreign files in ``dst``, and rewrite this rank's shards. ``workers``: threads converting one
    shard's tensors (default ``min(4, cpu count)``; the output bytes do not depend on it); torch's
    intra-op thread count is set to 1 while they run and restored afterwards.
    ``trust_remote_code``: run the checkpoint's own modeling code on a tiny configuration to find the
    Linears that read one input (their NVFP4 global scales are shared; needed only by recipes that
    give dense Linears NVFP4, refused clearly by those without it), and build the model on meta to
    check every dense tensor against it.

    Before anything is written: ``dst`` must not overlap ``src``; the routed experts must match
    config.json (``source_check``, the check ``load_pretrained`` runs); with ``trust_remote_code``
    the model is built on meta and every dense tensor is checked against it too. ``dst`` holding
    this job's complete output is nothing to do (``report.nothing_to_do``). Each rank holds a lock on
    ``dst`` while it works (``files/locks.py``): a second run on the same destination is refused,
    naming the holder. Source values that are not numbers refuse the shard that reads them
    (``allow_nonfinite_passthrough``: copied tensors pass unchanged, with a warning in the report).

    When ``torch.distributed`` is initialised the ranks meet in collectives and rank 0 finalizes;
    otherwise the rank that finds every shard complete when it finishes finalizes. Raises
    ``CheckpointError`` (naming the file) for a missing, truncated or inconsistent source shard,
    ``SourceMismatchError`` for tensors that disagree with the config, ``NonFiniteError`` for NaN/Inf,
    ``RecipeError`` for a recipe that needs calibration, ``FileExistsError``/``ConvertError`` for an
    output directory it must not write into, ``DestinationError`` for one that overlaps the source.
    """
    t0 = time.perf_counter()
    options = _options(rank, world_size, resume=resume, overwrite=overwrite, verify=verify, workers=workers,
                       progress=progress, allow_nonfinite_passthrough=allow_nonfinite_passthrough)
    src, dst = Path(src).absolute(), Path(dst).absolute()
    refuse_overlap(src, dst, flag="the output directory (--dst)")
    recipe = _as_recipe(recipe)
    _warn_ineffective_recipe_settings(recipe)
    steps = _Steps(_process_group(rank, world_size))
    plan = _checked_plan(steps, src, recipe, trust_remote_code)
    report = ConvertReport(src, dst, recipe.name, rank, world_size, len(plan.files))
    done = steps("check output", _check_dst, dst, plan, overwrite=overwrite)
    if done is not None:
        report.total, report.complete, report.nothing_to_do = done, True, True
    else:
        steps("check output is writable", check_writable, dst, flag="the output directory (--dst)", inside=True)
        if not _builds_model(src, trust_remote_code):
            report.notes.append(_DENSE_UNCHECKED)
        _convert_under_locks(steps, plan, dst, recipe, report, options)
    report.wall_s = time.perf_counter() - t0
    return report


def _builds_model(src: Path, trust_remote_code: bool) -> bool:
    """Whether the converter builds the model on meta to check the source as ``load_pretrained`` does: always
    for transformers' own classes (building runs no checkpoint code), for checkpoint code only when trusted."""
    from ..checkpoint import read_config
    from ..spec import get_spec

    return trust_remote_code or not get_spec(read_config(src).get("model_type", "")).loading.model_class.remote_code


def _checked_plan(steps: _Steps, src: Path, recipe: Recipe, trust_remote_code: bool) -> _Plan:
    """The plan, on every rank; every dense tensor is also checked against the model built on meta (as
    ``load_pretrained`` does: the same check, so both refuse the same sources) whenever building it runs
    no untrusted code (``_builds_model``)."""
    plan = steps("plan", _build_plan, src, recipe, trust_remote_code=trust_remote_code)
    if _builds_model(src, trust_remote_code):
        from ..load import check_against_model

        steps("check the checkpoint against the model", check_against_model, src, plan.source)
    return plan


def _convert_under_locks(
    steps: _Steps, plan: _Plan, dst: Path, recipe: Recipe, report: ConvertReport, options: _Options
) -> None:
    """Lock this rank's part of ``dst``, adopt it, convert this rank's shards and finalize when all are done."""
    locks: list[FileLock] = []
    try:
        steps("lock output", _lock_into, locks, dst, report, plan.fingerprint)
        steps.by_state_writer("prepare output", _prepare_dst, dst, plan, recipe)
        _convert_shards(steps, plan, dst, report, options)
        steps.by_state_writer("finalize", _finalize_if_ready, plan, dst, recipe, report)
    finally:
        for lock in locks:
            lock.release()
    if not report.complete:
        total = _complete_stats(dst, plan.fingerprint)  # another rank (or process) finished it
        if total is not None:
            report.total, report.complete, report.pending = total, True, []


def _lock_into(locks: list[FileLock], dst: Path, report: ConvertReport, fingerprint: str) -> None:
    """Take this rank's lock; it is appended at once, so a failure of another rank still releases it."""
    make_state_dirs(dst)  # refuses a symlink or a file planted where our state directories go
    try:
        locks.append(acquire_rank_lock(dst, dst / STATE_DIR / RANK_LOCK_DIR, rank=report.rank,
                                       world_size=report.world_size, fingerprint=fingerprint, notes=report.notes))
    except LockHeld as e:
        raise ConvertError(str(e)) from None


def _finalize_if_ready(plan: _Plan, dst: Path, recipe: Recipe, report: ConvertReport) -> None:
    report.pending = [f for f in plan.files if _load_record(dst, f, plan.fingerprint, verify_hash=False) is None]
    if not report.pending:
        report.total = _finalize(plan, dst, recipe)
        report.complete = report.finalized = True


def _complete_stats(dst: Path, fingerprint: str) -> ConvertStats | None:
    try:
        marker = json.loads((dst / COMPLETE_MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return ConvertStats.from_dict(marker["stats"]) if marker.get("fingerprint") == fingerprint else None


def _convert_shards(steps: _Steps, plan: _Plan, dst: Path, report: ConvertReport, options: _Options) -> None:
    """Convert this rank's shards (skipping complete ones when resuming), all ranks together."""
    # Parallelism is across modules (``workers``); torch's own intra-op threads only spin on these
    # per-module tensors (measured: 4x the CPU time with 2 intra-op threads on 2 cores).
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        steps("convert shards", _convert_mine, plan, dst, report, options)
    finally:
        torch.set_num_threads(torch_threads)
    if report.stats.nonfinite_passthrough:
        warn_passthrough(report.stats.nonfinite_passthrough)


def _convert_mine(plan: _Plan, dst: Path, report: ConvertReport, options: _Options) -> None:
    """Shard ``i`` of ``plan.files`` for ``i % world_size == rank``; shard k is fsynced, hashed, renamed and
    recorded (one finisher thread) while shard k + 1 is converted."""
    mine = plan.files[report.rank :: report.world_size]
    bar = _progress_bar(sum(len(plan.jobs[f]) for f in mine), report.rank, options.progress)
    pool = ThreadPoolExecutor(options.workers, thread_name_prefix="convert") if options.workers > 1 else None
    finisher = ThreadPoolExecutor(1, thread_name_prefix="convert-finish")
    finishing: list[tuple[str, Future]] = []
    try:
        for file in mine:
            if _resumed(plan, dst, file, report, options):
                bar.update(len(plan.jobs[file]))
                continue
            _record_path(dst, file).unlink(missing_ok=True)
            tmp, rec = _write_shard(plan, file, dst, pool, partial(bar.update, 1),
                                    allow_nonfinite_passthrough=options.allow_nonfinite_passthrough)
            _collect_finished(finishing, report)
            finishing.append((file, finisher.submit(_finish_shard, tmp, dst, rec)))
        _collect_finished(finishing, report)
    finally:
        wait([fut for _, fut in finishing])  # a shard written before a failure still gets its record
        finisher.shutdown()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        bar.close()
        plan.reader.close()


def _resumed(plan: _Plan, dst: Path, file: str, report: ConvertReport, options: _Options) -> bool:
    """Whether ``file`` is kept from an earlier run (its record validates); counted in the report if so."""
    if not options.resume or options.overwrite:
        return False
    rec = _load_record(dst, file, plan.fingerprint, verify_hash=options.verify)
    if rec is None:
        return False
    check_source(plan, dst, file, rec, verify_hash=options.verify)  # a changed source is refused, never mixed
    report.skipped.append(file)
    report.stats.add(ConvertStats.from_dict(rec["stats"]))
    return True


def _collect_finished(finishing: list[tuple[str, Future]], report: ConvertReport) -> None:
    while finishing:
        file, fut = finishing.pop(0)
        rec = fut.result()
        report.converted.append(file)
        report.stats.add(ConvertStats.from_dict(rec["stats"]))


def finalize_conversion(
    src: str | Path, dst: str | Path, recipe: Recipe | str | Path, *, trust_remote_code: bool = False
) -> ConvertStats:
    """Write index, configs, side files and the completion marker once every shard is complete.

    Idempotent; ``convert_checkpoint`` calls it on its own when it finds every shard complete.
    Raises ``ConvertError`` naming a shard that is not complete.
    """
    src, dst = Path(src).absolute(), Path(dst).absolute()
    recipe = _as_recipe(recipe)
    plan = _build_plan(src, recipe, trust_remote_code=trust_remote_code)
    if not (dst / STATE_DIR / JOB_FILE).is_file():
        raise ConvertError(f"{dst} holds no modelopt_k3 conversion ({STATE_DIR}/{JOB_FILE} is missing); run "
                           "convert_checkpoint (modelopt-k3-convert without --finalize) with this --dst first")
    for path, owner, record, _ in live_locks(dst / STATE_DIR / RANK_LOCK_DIR):
        if record.get("fingerprint") != plan.fingerprint:
            raise ConvertError(f"{dst} is being written by another conversion ({owner.describe()}); "
                               f"wait for it to end, or remove {path} if that run is dead")
    return _finalize(plan, dst, recipe)


def _progress_bar(total: int, rank: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"convert rank {rank}", disable=not enabled, leave=False)
