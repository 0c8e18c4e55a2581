"""One shard: convert its module jobs, copy its other tensors and write the output file in place
(``export.writer.PlannedShard``: header first, then each tensor at its offset)."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

from ..checkpoint import CheckpointError, ReadLog
from ..checkpoint.nonfinite import source_refusal
from ..checkpoint.source_decode import declared_shape_mismatch
from ..export.modelopt_format import input_scale_tensor
from ..export.writer import PlannedShard, write_json_atomic
from ..files.paths import is_staging_name, staging_path
from ..numerics.constants import NVFP4_BLOCK
from ..numerics.convert import mxfp4_to_nvfp4, shared_global_scale_for
from ..numerics.mxfp4 import mxfp4_decode
from .jobs import _ModuleJob, _Plan
from .report import ConvertStats
from .state import RECORD_VERSION, _fsync, _record_path, source_identity


class _ShardConverter:
    """Produces the output tensors of one module job (with a per-shard cache of shared scales).

    Every source tensor it reads (its own and its scale-sharing partners') is checked for values that
    are not numbers (``log.invalid``: name -> what): a job's output is then garbage, so the shard is
    refused (``_write_shard``). Copied tensors are checked as they pass (``copied_invalid``).
    """

    def __init__(self, plan: _Plan):
        self.plan = plan
        self.log = ReadLog(hashes={})  # every source byte a job reads is hashed as it is read
        self.copied_invalid: dict[str, str] = {}
        # output name -> sha256 (hex) of its bytes, known because they are a source tensor's, unchanged
        self.known_digests: dict[str, str] = {}
        self._group_scale: dict[tuple[str, ...], torch.Tensor] = {}

    def _read(self, key: str) -> torch.Tensor:
        return self.plan.reader.pread(key, self.log)

    def _weight(self, job: _ModuleJob) -> torch.Tensor:
        """The logical weight in the model's dtype (MXFP4, block-FP8 and INT4 decoded exactly, as the model path
        loads them: a block-FP8 dense Linear through the spec's dense converter, an encoded routed expert
        through its experts chain's decode step, into the model's dtype)."""
        if isinstance(job.decode, str):
            return self.plan.decode.dense_weight(job.decode, self._read, self.plan.dtype)
        if job.decode is not None:
            why = declared_shape_mismatch(self.plan.reader, job.decode, job.sources[0])
            if why:  # the load refuses the same checkpoint (one rule for both paths)
                raise CheckpointError(why)
            return job.decode.decode(self._read(job.sources[0]), self._read(job.sources[1]), self.plan.dtype)
        if len(job.sources) == 2:
            return mxfp4_decode(self._read(job.sources[0]), self._read(job.sources[1]), dtype=self.plan.dtype)
        return self._read(job.sources[0]).to(self.plan.dtype)

    def _shared_scale(self, job: _ModuleJob, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``weight_scale_2`` (NVFP4) or ``weight_scale`` (FP8) shared by ``job.group``.

        Partners are read from whichever shard holds them: only their E8M0 scales for the lossless
        cast, the whole (decoded) weight for an amax-derived scale.
        """
        if job.group in self._group_scale:
            return self._group_scale[job.group]
        members = [self.plan.modules[m] for m in job.group]
        if job.kind == "nvfp4_cast":
            scale = shared_global_scale_for(*(self._read(m.sources[1]) for m in members))
        else:
            amaxes = [
                (weight if m is job and weight is not None else self._weight(m)).float().abs().amax() for m in members
            ]
            amax = torch.stack(amaxes).amax()
            scale = job.fmt.weights.scale(amax)
        self._group_scale[job.group] = scale
        return scale

    def tensors(self, job: _ModuleJob) -> tuple[dict[str, torch.Tensor], ConvertStats]:
        """The job's output tensors (planned names) and its counters."""
        stats = ConvertStats()
        n_src = len(job.sources)
        if job.kind == "dense_decode":  # a kept Linear stored block-FP8: the model path writes its decoded weight
            stats.tensors["decoded"] += n_src
            return {job.name: self._weight(job)}, stats
        if job.kind == "decode":
            stats.tensors["decoded"] += n_src
            # The model path writes a left-BF16 routed expert as bf16 whatever the model dtype.
            return {f"{job.name}.weight": self._weight(job).to(torch.bfloat16)}, stats
        fmt = job.fmt
        if job.kind == "block_fp8_copy":  # the source's codes and scales as stored (quant/block_fp8_source.py)
            stats.tensors["passthrough"] += n_src
            stats.modules[fmt.algo] += 1
            codes = self._read(job.sources[0])
            out = {f"{job.name}.{k}": v for k, v in fmt.weights.block_fp8_tensors(codes, self._read(job.sources[1])).items()}
            if out[f"{job.name}.weight"] is codes:  # the source buffer itself: its read-time sha256 is its digest
                self.known_digests[f"{job.name}.weight"] = self.log.hashes[job.sources[0]]
            return out, stats
        stats.tensors[fmt.algo] += n_src
        stats.modules[fmt.algo] += 1
        if job.kind == "nvfp4_cast":
            codes = self._read(job.sources[0])
            q, n_req = mxfp4_to_nvfp4(codes, self._read(job.sources[1]), self._shared_scale(job), share_codes=True)
            blocks = job.shape[0] * job.shape[1] // NVFP4_BLOCK
            stats.expert_blocks_requantized += n_req
            stats.expert_blocks_lossless += blocks - n_req
            tensors = fmt.weights.cast_tensors(q.packed, q.block_scale, q.global_scale)
            out = {f"{job.name}.{k}": v for k, v in tensors.items()}
            if q.packed.data_ptr() == codes.data_ptr() and q.packed.nbytes == codes.nbytes:
                # Every code byte carried over: the output tensor is the source buffer, whose sha256 was
                # taken as it was read (``ReadLog.hashes``); hashing it again would be a second pass.
                for name, t in out.items():
                    if t is q.packed:
                        self.known_digests[name] = self.log.hashes[job.sources[0]]
        else:
            weight = self._weight(job)
            scale = self._shared_scale(job, weight) if fmt.weights.per_tensor_scale else None
            out = {f"{job.name}.{k}": v for k, v in fmt.weights.weight_tensors(weight, scale).items()}
        if fmt.inputs is not None:
            # As the model path's constant-amax input quantizer: an fp32 amax buffer -> its scale.
            amax = torch.full((), job.input_amax, dtype=torch.float32)
            out[f"{job.name}.input_scale"] = input_scale_tensor(fmt.inputs.scale(amax))
        return out, stats


    def run(self, job: str | _ModuleJob, shard: PlannedShard, passthrough: bool) -> ConvertStats:
        """Copy (a source key) or convert (a module job) into ``shard``; NaN/Inf in a copied tensor is let
        through (``passthrough``, counted in the stats) or kept for the refusal."""
        if isinstance(job, str):
            done = ConvertStats()
            found = shard.copy(self.plan.reader, job)
            if found is not None:
                (done.nonfinite_passthrough if passthrough else self.copied_invalid)[job] = found
            done.tensors["copied"] += 1
            return done
        out, done = self.tensors(job)
        for name, tensor in out.items():
            known = self.known_digests.pop(name, None)
            shard.write(name, tensor, None if known is None else bytes.fromhex(known))
        return done


def _write_shard(
    plan: _Plan, file: str, dst: Path, pool: ThreadPoolExecutor | None, on_item: Callable[[], None], *,
    allow_nonfinite_passthrough: bool = False,
) -> tuple[Path, dict]:
    """Write source shard ``file`` into a fresh staging file ``dst/.<file>.<32 hex>.partial``
    (``files.paths.staging_path``, created with O_EXCL | O_NOFOLLOW: a planted file or symlink is never
    opened); return it and its record.

    Jobs (copies and modules) run on ``pool`` when given; each writes its own byte ranges and adds their
    sha256 to the shard's digest (``ShardDigest``), so the file is never read back to be hashed. Source
    values that are not numbers refuse the shard (``NonFiniteError`` naming every such tensor it
    read), except in copied tensors with ``allow_nonfinite_passthrough`` (recorded in its stats).
    On any failure the partial file is removed: a rerun rewrites the whole shard anyway.
    """
    stats = ConvertStats(shards=1, bytes_in=plan.sizes[file])
    _remove_partials(dst, file)  # a killed run's: this rank owns ``file`` (its lock) and rewrites it whole
    shard = PlannedShard(staging_path(dst / file), plan.outputs(file))
    converter = _ShardConverter(plan)
    try:
        _run_jobs(converter, plan.jobs[file], shard, pool, allow_nonfinite_passthrough, stats, on_item)
        invalid = {**converter.log.invalid, **converter.copied_invalid}
        if invalid:
            raise source_refusal(invalid, passthrough_possible=not converter.log.invalid)
    except BaseException:
        shard.discard()
        raise
    shard.close()
    stats.bytes_out = shard.total_bytes
    return shard.path, _shard_record(plan, file, shard, stats, {**converter.log.hashes, **shard.copied})


def _remove_partials(dst: Path, file: str) -> None:
    for path in dst.iterdir():
        if is_staging_name(path.name, file, "partial"):
            path.unlink(missing_ok=True)  # the name itself: a symlink is removed, never followed


def _run_jobs(
    converter: _ShardConverter, jobs: list[str | _ModuleJob], shard: PlannedShard, pool: ThreadPoolExecutor | None,
    passthrough: bool, stats: ConvertStats, on_item: Callable[[], None],
) -> None:
    """Run every job into ``shard`` (on ``pool`` when given), adding its counters to ``stats`` in job order."""
    if pool is None:
        for job in jobs:
            stats.add(converter.run(job, shard, passthrough))
            on_item()
        return
    futures = [pool.submit(converter.run, job, shard, passthrough) for job in jobs]
    try:
        for fut in futures:
            stats.add(fut.result())
            on_item()
    except BaseException:
        for fut in futures:
            fut.cancel()
        wait(futures)  # no job may still write once the shard's file is closed
        raise


def _shard_record(plan: _Plan, file: str, shard: PlannedShard, stats: ConvertStats, read: dict[str, str]) -> dict:
    """The completion record. ``source.read``: the sha256 of every source tensor the shard was made from
    (its own file's and scale partners' in other files), taken while streaming; a resume checks them
    (``state.check_source``), so a source changed since is refused, never mixed in."""
    return {
        "version": RECORD_VERSION,
        "fingerprint": plan.fingerprint,
        "source": {"file": file, "size": plan.sizes[file], "identity": source_identity(plan, read),
                   "read": dict(sorted(read.items()))},
        "output": {"file": file, "size": shard.total_bytes, "digest": shard.digest.hexdigest()},
        "tensors": sorted(shard.planned),
        "tensor_bytes": shard.tensor_bytes,
        "stats": stats.to_dict(),
    }


def _finish_shard(tmp: Path, dst: Path, record: dict) -> dict:
    """fsync the written shard, rename it into place, then save its completion record (its digest was
    taken while writing)."""
    file = record["output"]["file"]
    _fsync([tmp])
    os.replace(tmp, dst / file)
    _fsync([dst])  # the rename is durable before the record claims it
    write_json_atomic(_record_path(dst, file), record)
    return record
