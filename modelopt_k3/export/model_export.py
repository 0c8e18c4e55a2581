"""``export_checkpoint``: each rank quantizes and writes what it owns; only the index travels.

Ownership: a rank writes its own experts (expert parallel; under FSDP2 the expert rows of its shards)
and a deterministic share of the dense work (quantized Linears and pass-through tensors, item ``i`` to
rank ``i % world``). Under FSDP2 the owner of a quantized Linear gathers that one weight from the
other ranks' shards (peak: the largest dense weight), quantizes it and writes it under one key.
Pass-through tensors are copied from the source checkpoint, so everything left unquantized keeps its
source name, dtype and bytes. Rank 0 writes the index, ``config.json``, ``hf_quant_config.json`` and
copies the remote code and tokenizer. All of it happens in one temporary directory renamed into place
at the end.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..checkpoint import CheckpointReader
from ..dist.collectives import run_together
from ..dist.fsdp import gather_to_owner, local_rows
from ..dist.group import current_group
from ..experts.packed import expert_weight_rows, release_decode_workspaces
from ..files.paths import refuse_overlap
from ..quant.modules import ExpertsQuantState
from .layouts import ExportFormat, export_format
from .modelopt_format import input_scale_tensor
from .writer import (
    DEFAULT_MAX_SHARD_BYTES,
    ShardWriter,
    atomic_output_dir,
    copy_side_files,
    gather_weight_maps,
    write_configs,
    write_index,
)

EXPERTS_PER_CAST = 16


def _kv_scales(model: nn.Module) -> dict[str, nn.Module]:
    """Exported KV-cache scale key -> the attention module whose ``kv_cache_quantizer`` holds it."""
    return {
        f"{name}.{key}": module
        for name, module in model.named_modules()
        for key in getattr(module, "kv_scale_names", ())
    }


def _dense_items(qplan, reader: CheckpointReader, expert_key_re: re.Pattern, kv_keys,
                 decoded: dict[str, tuple[str, ...]] | None = None) -> list[tuple[str, str]]:
    """Sorted work items ("quant", module) / ("copy", source key) / ("kv", key) / ("decoded", name) for all
    but routed experts. ``decoded``: dense names decoded from a source format at load (a block-FP8 Linear) ->
    their source keys: written from the model's decoded value (as ModelOpt writes a dequantized FP8 Linear
    it keeps), their source keys never copied."""
    decoded = decoded or {}
    items = [("quant", name) for name in qplan.dense]
    owned = {f"{name}.weight" for name in qplan.dense} | {key for keys in decoded.values() for key in keys}
    items += [("decoded", name) for name in decoded if name not in {f"{m}.weight" for m in qplan.dense}]
    items += [("copy", key) for key in reader.names() if key not in owned and not expert_key_re.match(key)]
    items += [("kv", key) for key in kv_keys]
    return sorted(items, key=lambda it: it[1])


def _quant_linear_tensors(module: nn.Module, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    wq = module.weight_quantizer
    out = wq.fmt.weight_tensors(wq.weight_to_quantize(weight), wq.scale() if wq.fmt.per_tensor_scale else None,
                                **wq.searched_scales())
    if module.input_quantizer is not None:
        out["input_scale"] = input_scale_tensor(module.input_quantizer.scale())
    return out


def _expert_tensors(name: str, experts: nn.Module, spec, projs: dict) -> Iterator[tuple[str, dict[str, torch.Tensor], bool]]:
    """Per-expert ``(prefix, tensors, quantized)`` under the checkpoint's names ``{name}.{e}.{proj}``.

    Only the experts this rank holds. Quantizer scales span the module's expert dim (index ``idx``);
    local weights and casts hold this rank's rows (index ``local``): the same unless FSDP2-sharded.
    Weights are taken ``EXPERTS_PER_CAST`` experts at a time, and only where no cast replaces them
    (packed-resident experts decode them then).
    """
    state: ExpertsQuantState | None = getattr(experts, "quant", None)
    rows = local_rows(getattr(experts, spec.experts.projections[0].fused_param))
    cast: dict[str, object] = {}
    weights: dict[str, torch.Tensor] = {}
    part = slice(0, 0)
    wqs = {proj.name: state.weight[proj.fused_param] if state is not None and proj.name in projs else None
           for proj in spec.experts.projections}
    # Each quantizer's scales, computed once per module (they span every expert), not once per expert.
    scales: dict[int, torch.Tensor] = {}

    def scale_of(q) -> torch.Tensor:
        if id(q) not in scales:
            scales[id(q)] = q.scale()
        return scales[id(q)]

    for idx, expert in zip(rows, experts.placement.global_ids(rows)):
        local = idx - rows.start
        if local % EXPERTS_PER_CAST == 0:
            # Lossless casts of the source bytes, a few experts at a time (bounded export memory).
            part = slice(local, min(local + EXPERTS_PER_CAST, len(rows)))
            cast.clear()
            weights.clear()
            for proj in spec.experts.projections:
                wq = wqs[proj.name]
                if wq is not None and wq.source is not None:
                    cast[proj.name] = wq.source[0].cast(proj.name, scale_of(wq), part)
        in_part = local % EXPERTS_PER_CAST
        for proj in spec.experts.projections:
            prefix = f"{name}.{expert}.{proj.name}"
            wq = wqs[proj.name]
            if proj.name in cast:
                c = cast[proj.name]
                tensors = wq.fmt.cast_tensors(c.packed[in_part], c.block_scale[in_part], scale_of(wq)[idx])
            else:
                if proj.fused_param not in weights:
                    weights[proj.fused_param] = expert_weight_rows(experts, proj.fused_param, part)
                weight = weights[proj.fused_param][in_part].chunk(proj.n_chunks, dim=0)[proj.chunk]
                if wq is None:
                    yield prefix, {"weight": weight.to(torch.bfloat16).contiguous()}, False
                    continue
                tensors = wq.fmt.weight_tensors(weight, scale_of(wq)[idx] if wq.fmt.per_tensor_scale else None,
                                                **wq.searched_scales(idx, (proj.chunk, proj.n_chunks)))
            if proj.fused_param in state.input:
                tensors["input_scale"] = input_scale_tensor(scale_of(state.input[proj.fused_param])).clone()
            yield prefix, tensors, True


def export_checkpoint(
    model: nn.Module,
    export_dir: str | Path,
    *,
    format: str | ExportFormat = "modelopt",
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
) -> Path:
    """Write the quantized model as a ModelOpt Hugging Face checkpoint; returns ``export_dir``.

    Call on every rank. Nothing is gathered: each rank writes its own shard files.
    """
    fmt = export_format(format)
    info, qplan = _check_exportable(model, Path(export_dir), fmt)
    group = current_group()
    export_dir = Path(export_dir)
    job = _ExportJob(model, info, qplan, fmt, group)
    release_decode_workspaces(job.experts_modules.values())  # export never runs the experts: give it back first
    with atomic_output_dir(export_dir, overwrite=overwrite, group=group) as tmp:
        weight_map, nbytes = run_together("export write shards", _write_rank_share, job, tmp, max_shard_bytes,
                                          progress, group=group)
        maps, total = gather_weight_maps(weight_map, nbytes, group=group)
        run_together("export index and configs", _write_index_and_configs, job, tmp, maps, total, group=group)
    return export_dir


def _check_exportable(model: nn.Module, export_dir: Path, fmt: ExportFormat):
    """Stage 1: refuse what cannot be exported before anything is written; returns (LoadInfo, QuantPlan)."""
    info = getattr(model, "modelopt_k3", None)
    qplan = getattr(model, "modelopt_k3_quant", None)
    if info is None or qplan is None:
        raise ValueError("export_checkpoint expects a model from load_pretrained that went through quantize")
    refuse_overlap(info.checkpoint, export_dir, flag="export_dir")  # the copies read the source to the end
    why = fmt.unexpressible(set(qplan.table.layer_algos().values()), qplan.recipe.kv_cache)
    if why is not None:
        raise ValueError(f"{why}. Use format='modelopt' for it.")
    return info, qplan


class _ExportJob:
    """What every export stage reads: the model's modules, its load info and quantization plan, the layout
    of the export format and the run group. Whether this rank writes experts is the placement's word."""

    def __init__(self, model: nn.Module, info, qplan, fmt: ExportFormat, group) -> None:
        self.info, self.qplan, self.fmt, self.group = info, qplan, fmt, group
        self.spec = info.spec
        self.modules = dict(model.named_modules())
        self.experts_modules = self.spec.experts_modules(model)
        self.kv_scales = _kv_scales(model)
        self.writes_experts = info.placement.experts.writes_experts


def _write_rank_share(job: _ExportJob, tmp: Path, max_shard_bytes: int, progress: bool) -> tuple[dict[str, str], int]:
    """Stage 2: this rank's dense items (item ``i`` to rank ``i % world``) and, if it writes them, its experts."""
    group = job.group
    # The load's reader of the source (headers read once per run); ``with`` closes only its file handles.
    with job.info.source() as reader, ShardWriter(
        tmp, rank=group.rank, max_shard_bytes=max_shard_bytes
    ) as writer:
        items = _dense_items(job.qplan, reader, re.compile(job.spec.experts.key_regex), job.kv_scales,
                             job.info.decoded_dense)
        n_experts = sum(m.num_experts for m in job.experts_modules.values()) if job.writes_experts else 0
        n_mine = len(items[group.rank :: group.world_size])
        bar = tqdm(total=n_mine + n_experts, desc=f"export rank {group.rank}", disable=not progress, leave=False)
        _write_dense_items(job, items, reader, writer, bar)
        if job.writes_experts:
            _write_experts(job, writer, bar)
        bar.close()
        weight_map = writer.close()
        return weight_map, writer.total_bytes


def _write_dense_items(job: _ExportJob, items: list[tuple[str, str]], reader: CheckpointReader,
                       writer: ShardWriter, bar: tqdm) -> None:
    group = job.group
    failed: Exception | None = None
    for i, (kind, name) in enumerate(items):
        owner = i % group.world_size  # item i belongs to rank i % world
        # An FSDP2-sharded weight is gathered to its owner only, one tensor at a time. Every rank
        # joins every gather, so a rank that failed keeps joining and raises after the loop.
        weight = gather_to_owner(job.modules[name].weight, owner) if kind == "quant" else None
        if kind == "decoded":
            module, _, attr = name.rpartition(".")
            weight = gather_to_owner(getattr(job.modules[module], attr), owner)
        if owner != group.rank or failed is not None:
            continue
        try:
            if kind == "copy":
                writer.add(name, reader.get(name))
            elif kind == "decoded":
                writer.add(name, weight.detach().contiguous())
            elif kind == "kv":
                scale = job.kv_scales[name].kv_cache_quantizer.scale()
                writer.add(name, job.qplan.recipe.kv_cache.scale_tensor(scale))
            else:
                for key, tensor in job.fmt.rename_tensors(_quant_linear_tensors(job.modules[name], weight)).items():
                    writer.add(f"{name}.{key}", tensor)
        except Exception as exc:
            failed = exc
        bar.update(1)
    if failed is not None:
        raise failed


def _write_experts(job: _ExportJob, writer: ShardWriter, bar: tqdm) -> None:
    for name, experts in job.experts_modules.items():
        projs = job.qplan.experts.get(name, {})
        for prefix, tensors, quantized in _expert_tensors(name, experts, job.spec, projs):
            for key, tensor in (job.fmt.rename_tensors(tensors) if quantized else tensors).items():
                writer.add(f"{prefix}.{key}", tensor)
        bar.update(experts.num_experts)


def _write_index_and_configs(job: _ExportJob, tmp: Path, maps, total: int) -> None:
    """Stage 3 (rank 0): the index, config.json with its quantization_config, hf_quant_config.json, side files."""
    if not job.group.is_main:
        return
    info, qplan = job.info, job.qplan
    write_index(tmp, maps, total)
    qcfg, hf_quant = job.fmt.configs(qplan.table.layer_algos(), qplan.table.unquantized_modules(), qplan.recipe,
                                     qplan.table.naming)
    write_configs(info.checkpoint, tmp, qcfg, hf_quant)
    copy_side_files(info.checkpoint, tmp)
