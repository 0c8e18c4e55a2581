"""One shard: convert its module jobs, copy its other tensors and write the output file in place."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

from ..checkpoint import _ST_DTYPES, CheckpointError
from ..export.modelopt_format import (
    input_scale_tensor,
    weight_tensors,
)
from ..nonfinite import invalid_values, source_refusal
from ..numerics import fp8 as fp8n
from ..numerics import nvfp4 as nvn
from ..numerics.constants import NVFP4_BLOCK
from ..numerics.convert import mxfp4_to_nvfp4, shared_global_scale_for
from ..numerics.finite import nonfinite_count
from ..numerics.mxfp4 import mxfp4_decode
from .plan import _ModuleJob, _Out, _Plan
from .report import ConvertStats
from .source import _pread_into, _SourceFiles, _SrcTensor
from .state import RECORD_VERSION, _record_path, _sha256, _write_json_atomic

_ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}
_COPY_CHUNK = 64 * 2**20
_HAS_COPY_FILE_RANGE = hasattr(os, "copy_file_range")


class _ShardConverter:
    """Produces the output tensors of one module job (with a per-shard cache of shared scales).

    Every source tensor it reads (its own and its scale-sharing partners') is checked for values that
    are not numbers; ``invalid`` collects them (name -> what): a job's output is then garbage, so the
    shard is refused (``_write_shard``).
    """

    def __init__(self, plan: _Plan, reader: _SourceFiles):
        self.plan = plan
        self.reader = reader
        self._group_scale: dict[tuple[str, ...], torch.Tensor] = {}
        self.invalid: dict[str, str] = {}

    def _read(self, key: str) -> torch.Tensor:
        tensor = self.reader.read(key)
        found = invalid_values(key, tensor)
        if found is not None:
            self.invalid[key] = found
        return tensor

    def _weight(self, job: _ModuleJob) -> torch.Tensor:
        """The logical weight in the model's dtype (MXFP4 decoded exactly, as the model path loads it)."""
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
            scale = nvn.nvfp4_global_scale(amax) if job.fmt.weights == "nvfp4" else fp8n.fp8_scale(amax)
        self._group_scale[job.group] = scale
        return scale

    def tensors(self, job: _ModuleJob) -> tuple[dict[str, torch.Tensor], ConvertStats]:
        """The job's output tensors (planned names) and its counters."""
        stats = ConvertStats()
        n_src = len(job.sources)
        if job.kind == "decode":
            stats.tensors["decoded"] += n_src
            # The model path writes a left-BF16 routed expert as bf16 whatever the model dtype.
            return {f"{job.name}.weight": self._weight(job).to(torch.bfloat16)}, stats
        fmt = job.fmt
        stats.tensors[fmt.algo] += n_src
        stats.modules[fmt.algo] += 1
        if job.kind == "nvfp4_cast":
            q, n_req = mxfp4_to_nvfp4(self._read(job.sources[0]), self._read(job.sources[1]), self._shared_scale(job))
            blocks = job.shape[0] * job.shape[1] // NVFP4_BLOCK
            stats.expert_blocks_requantized += n_req
            stats.expert_blocks_lossless += blocks - n_req
            out = {
                f"{job.name}.weight": q.packed,
                f"{job.name}.weight_scale": q.block_scale,
                f"{job.name}.weight_scale_2": q.global_scale.reshape(()).to(torch.float32),
            }
        else:
            weight = self._weight(job)
            scale = None if fmt.weights == "fp8_pb" else self._shared_scale(job, weight)
            out = {f"{job.name}.{k}": v for k, v in weight_tensors(fmt.weights, weight, scale).items()}
        if fmt.inputs is not None:
            # As the model path's constant-amax input quantizer: an fp32 amax buffer -> its scale.
            amax = torch.full((), job.input_amax, dtype=torch.float32)
            scale = nvn.nvfp4_global_scale(amax) if fmt.inputs == "nvfp4" else fp8n.fp8_scale(amax)
            out[f"{job.name}.input_scale"] = input_scale_tensor(scale)
        return out, stats


def _layout(outputs: list[_Out]) -> tuple[bytes, dict[str, int]]:
    """Safetensors header bytes (length prefix included) and each tensor's absolute file offset.

    Tensors are laid out by element size (largest first), then production order, so every tensor
    starts at a multiple of its element size, as safetensors' own writer does.
    """
    order = sorted(range(len(outputs)), key=lambda i: (-outputs[i].dtype.itemsize, i))
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    rel: dict[str, int] = {}
    pos = 0
    for i in order:
        o = outputs[i]
        header[o.name] = {"dtype": _ST_NAMES[o.dtype], "shape": list(o.shape), "data_offsets": [pos, pos + o.nbytes]}
        rel[o.name] = pos
        pos += o.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {name: start + off for name, off in rel.items()}


def _tensor_bytes(t: torch.Tensor):
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy() if t.numel() else b""


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _write_shard(
    plan: _Plan, file: str, dst: Path, reader: _SourceFiles, pool: ThreadPoolExecutor | None,
    on_item: Callable[[], None], *, allow_nonfinite_passthrough: bool = False,
) -> tuple[Path, dict]:
    """Write source shard ``file`` into ``dst/.<file>.partial``; return it and its record (no sha256 yet).

    Jobs (copies and modules) run on ``pool`` when given; each writes its own byte ranges. Source
    values that are not numbers refuse the shard (``NonFiniteError`` naming every such tensor it
    read), except in copied tensors with ``allow_nonfinite_passthrough`` (recorded in its stats).
    On any failure the partial file is removed: a rerun rewrites the whole shard anyway.
    """
    stats = ConvertStats(shards=1, bytes_in=plan.sizes[file])
    outputs: list[_Out] = []
    for job in plan.jobs[file]:
        if isinstance(job, str):
            t = plan.tensors[job]
            outputs.append(_Out(job, t.dtype, t.shape))
        else:
            outputs.extend(job.outputs)
    header, offsets = _layout(outputs)
    total = len(header) + sum(o.nbytes for o in outputs)
    expected = {o.name: o for o in outputs}
    tmp = dst / f".{file}.partial"
    converter = _ShardConverter(plan, reader)
    copied_invalid: dict[str, str] = {}
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def run(job: str | _ModuleJob) -> ConvertStats:
        if isinstance(job, str):
            done = ConvertStats()
            found = _copy_range(reader, plan.tensors[job], fd, offsets[job])
            if found is not None:
                (done.nonfinite_passthrough if allow_nonfinite_passthrough else copied_invalid)[job] = found
            done.tensors["copied"] += 1
            return done
        out, done = converter.tensors(job)
        for name, tensor in out.items():
            want = expected[name]
            if tensor.dtype != want.dtype or tuple(tensor.shape) != want.shape:
                raise AssertionError(
                    f"{name}: produced {tensor.dtype} {list(tensor.shape)}, planned {want.dtype} {list(want.shape)}"
                )
            _pwrite_all(fd, _tensor_bytes(tensor), offsets[name])
        return done

    try:
        _pwrite_all(fd, header, 0)
        os.ftruncate(fd, total)
        if pool is None:
            for job in plan.jobs[file]:
                stats.add(run(job))
                on_item()
        else:
            futures = [pool.submit(run, job) for job in plan.jobs[file]]
            try:
                for fut in futures:
                    stats.add(fut.result())
                    on_item()
            except BaseException:
                for fut in futures:
                    fut.cancel()
                wait(futures)  # no job may still write once fd is closed
                raise
        invalid = {**converter.invalid, **copied_invalid}
        if invalid:
            raise source_refusal(invalid, passthrough_possible=not converter.invalid)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    stats.bytes_out = total
    record = {
        "version": RECORD_VERSION,
        "fingerprint": plan.fingerprint,
        "source": {"file": file, "size": plan.sizes[file]},
        "output": {"file": file, "size": total, "sha256": None},
        "tensors": sorted(expected),
        "tensor_bytes": sum(o.nbytes for o in outputs),
        "stats": stats.to_dict(),
    }
    return tmp, record


def _finish_shard(tmp: Path, dst: Path, record: dict) -> dict:
    """fsync and hash the written shard, rename it into place, then save its completion record."""
    file = record["output"]["file"]
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    record["output"]["sha256"] = _sha256(tmp)
    os.replace(tmp, dst / file)
    dir_fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename is durable before the record claims it
    finally:
        os.close(dir_fd)
    _write_json_atomic(_record_path(dst, file), record)
    return record


def _copy_range(reader: _SourceFiles, t: _SrcTensor, out_fd: int, out_offset: int) -> str | None:
    """Copy one tensor's bytes; return what in them is not a number (None: all are).

    Floating tensors pass through this process in chunks, each checked as it goes by (``nonfinite_count``
    on bytes already in memory); other tensors cannot hold NaN and move in the kernel where it can.
    """
    if t.dtype.is_floating_point:
        return _copy_checked(reader, t, out_fd, out_offset)
    _copy_unchecked(reader, t, out_fd, out_offset)
    return None


def _copy_unchecked(reader: _SourceFiles, t: _SrcTensor, out_fd: int, out_offset: int) -> None:
    """``copy_file_range`` where the filesystem allows, else pread/pwrite."""
    src_fd = reader.fd(t.file)
    done = 0
    if _HAS_COPY_FILE_RANGE:
        try:
            while done < t.nbytes:
                n = os.copy_file_range(src_fd, out_fd, t.nbytes - done, t.offset + done, out_offset + done)
                if n == 0:
                    raise CheckpointError(
                        f"{reader.src / t.file} is truncated: read stopped at byte {t.offset + done}"
                    )
                done += n
            return
        except OSError:  # EXDEV, ENOSYS, EINVAL on some filesystems: finish with plain reads
            pass
    while done < t.nbytes:
        chunk = _pread_chunk(reader, t, src_fd, done)
        _pwrite_all(out_fd, chunk, out_offset + done)
        done += len(chunk)


def _pread_chunk(reader: _SourceFiles, t: _SrcTensor, src_fd: int, done: int) -> bytes:
    chunk = os.pread(src_fd, min(_COPY_CHUNK, t.nbytes - done), t.offset + done)
    if not chunk:
        raise CheckpointError(f"{reader.src / t.file} is truncated: read stopped at byte {t.offset + done}")
    return chunk


def _copy_checked(reader: _SourceFiles, t: _SrcTensor, out_fd: int, out_offset: int) -> str | None:
    src_fd = reader.fd(t.file)
    buf = torch.empty(min(_COPY_CHUNK, t.nbytes), dtype=torch.uint8)  # chunks hold whole elements
    view = memoryview(buf.numpy())
    bad = done = 0
    while done < t.nbytes:
        n = min(len(view), t.nbytes - done)
        _pread_into(src_fd, view[:n], t.offset + done, reader.src / t.file)
        bad += nonfinite_count(buf[:n].view(t.dtype))
        _pwrite_all(out_fd, view[:n], out_offset + done)
        done += n
    return f"{bad} NaN/Inf value{'s' if bad != 1 else ''}" if bad else None
