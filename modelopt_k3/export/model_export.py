"""``export_planned``: each rank quantizes and writes what it owns; only the index travels.

The stage takes the run's ``QuantPlan`` (which holds the load), the resolved format and the run group;
``export_checkpoint`` is the library's convenience over it, taking the plan off the model ``quantize`` returned.

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
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..checkpoint import CheckpointReader
from ..checkpoint.serving_rules import refuse_unservable
from ..checkpoint.source_decode import carried_items, carried_value
from ..dist.collectives import run_together
from ..dist.fsdp import gather_to_owner, local_rows
from ..dist.group import current_group
from ..experts.packed import expert_weight_rows, release_decode_workspaces
from ..files.paths import refuse_overlap
from ..quant.api import QuantPlan, quantized_plan
from ..quant.modules import ExpertsQuantState
from ..spec.names import is_under, under_any
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
                 decoded: dict[str, tuple[str, ...]] | None = None,
                 carried: Mapping[str, tuple[str, tuple[str, ...]]] | None = None) -> list[tuple[str, str]]:
    """Sorted work items ("quant", module) / ("copy", source key) / ("kv", key) / ("decoded", name) /
    ("carried", name) for all but routed experts. ``decoded``: dense names decoded from a source format at load
    (a block-FP8 Linear) -> their source keys: written from the model's decoded value (as ModelOpt writes a
    dequantized FP8 Linear it keeps), their source keys never copied. ``carried``: what the tensors of modules
    the model does not build become (``source_decode.carried_items``), read from the source, routed experts too."""
    decoded, carried = decoded or {}, carried or {}
    items = [("quant", name) for name in qplan.dense]
    owned = {f"{name}.weight" for name in qplan.dense} | {key for keys in decoded.values() for key in keys}
    owned |= {key for _, keys in carried.values() for key in keys}
    items += [("decoded", name) for name in decoded if name not in {f"{m}.weight" for m in qplan.dense}]
    items += [("carried", name) for name in carried]
    items += [("copy", key) for key in reader.names() if key not in owned and not expert_key_re.match(key)]
    items += [("kv", key) for key in kv_keys]
    return sorted(items, key=lambda it: it[1])


def _quant_linear_tensors(module: nn.Module, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    wq = module.weight_quantizer
    if wq.passes_through:  # the block-FP8 source's own codes and scales, read now by the rank writing them
        out = wq.block_source.tensors(wq.fmt)
    else:
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
                    w = expert_weight_rows(experts, proj.fused_param, part)
                    # A weight-updating calibrator's values (GPTQ), indexed by the quantizer's expert dim.
                    weights[proj.fused_param] = w if wq is None else wq.weight_to_quantize(
                        w, experts=slice(rows.start + part.start, rows.start + part.stop))
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
    """Write the quantized model as a ModelOpt Hugging Face checkpoint; returns ``export_dir``: the library's
    ``export_planned`` of the plan ``quantize`` left on ``model``, in the current run group.

    Call on every rank. Nothing is gathered: each rank writes its own shard files.
    """
    return export_planned(model, quantized_plan(model, "export_checkpoint"), export_dir, export_format(format),
                          group=current_group(), overwrite=overwrite, max_shard_bytes=max_shard_bytes,
                          progress=progress)


def export_planned(
    model: nn.Module,
    qplan: QuantPlan,
    export_dir: str | Path,
    fmt: ExportFormat,
    *,
    group,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
) -> Path:
    """The export stage: ``model`` quantized per ``qplan`` written in ``fmt`` (the run's resolved format) into
    ``export_dir`` by every rank of ``group``; returns ``export_dir``."""
    export_dir = Path(export_dir)
    _check_exportable(qplan, export_dir, fmt)
    job = _ExportJob(model, qplan, fmt, group)
    release_decode_workspaces(job.experts_modules.values())  # export never runs the experts: give it back first
    with atomic_output_dir(export_dir, overwrite=overwrite, group=group) as tmp:
        weight_map, nbytes = run_together("export write shards", _write_rank_share, job, tmp, max_shard_bytes,
                                          progress, group=group)
        maps, total = gather_weight_maps(weight_map, nbytes, group=group)
        run_together("export index and configs", _write_index_and_configs, job, tmp, maps, total, group=group)
    return export_dir


def _check_exportable(qplan: QuantPlan, export_dir: Path, fmt: ExportFormat) -> None:
    """Stage 1: refuse what cannot be exported before anything is written."""
    refuse_overlap(qplan.load.checkpoint, export_dir, flag="export_dir")  # the copies read the source to the end
    why = fmt.unexpressible(set(qplan.table.layer_algos().values()), qplan.recipe.kv_cache)
    if why is not None:
        raise ValueError(f"{why}. Use format='modelopt' for it.")


class _ExportJob:
    """What every export stage reads: the model's modules, its load info and quantization plan, the layout
    of the export format and the run group. Whether this rank writes experts is the placement's word."""

    def __init__(self, model: nn.Module, qplan: QuantPlan, fmt: ExportFormat, group) -> None:
        self.info, self.qplan, self.fmt, self.group = qplan.load, qplan, fmt, group
        info = self.info
        self.spec = info.spec
        self.modules = dict(model.named_modules())
        self.experts_modules = self.spec.experts_modules(model)
        self.kv_scales = _kv_scales(model)
        self.writes_experts = info.placement.experts.writes_experts
        # the tensors of modules the model does not build (MTP layers): output name -> how, from which keys
        self.carried = carried_items(info.carried_keys, info.carried_decode, re.compile(self.spec.experts.key_regex))


def _write_rank_share(job: _ExportJob, tmp: Path, max_shard_bytes: int, progress: bool) -> tuple[dict[str, str], int]:
    """Stage 2: this rank's dense items (item ``i`` to rank ``i % world``) and, if it writes them, its experts."""
    group = job.group
    # The load's reader of the source (headers read once per run); ``with`` closes only its file handles.
    with job.info.source() as reader, ShardWriter(
        tmp, rank=group.rank, max_shard_bytes=max_shard_bytes
    ) as writer:
        items = _dense_items(job.qplan, reader, re.compile(job.spec.experts.key_regex), job.kv_scales,
                             job.info.decoded_dense, job.carried)
        n_experts = sum(m.num_experts for m in job.experts_modules.values()) if job.writes_experts else 0
        n_mine = len(items[group.rank :: group.world_size])
        bar = tqdm(total=n_mine + n_experts, desc=f"export rank {group.rank}", disable=not progress, leave=False)
        _write_dense_items(job, with_owners(items, group.world_size), reader, writer, bar)
        if job.writes_experts:
            _write_experts(job, writer, bar)
        bar.close()
        weight_map = writer.close()
        return weight_map, writer.total_bytes


def with_owners(items: list[tuple[str, str]], world_size: int) -> list[tuple[int, str, str]]:
    """``(owner, kind, name)``: item ``i`` of the sorted list belongs to rank ``i % world``."""
    return [(i % world_size, kind, name) for i, (kind, name) in enumerate(items)]


def _write_dense_items(job: _ExportJob, items: list[tuple[int, str, str]], reader: CheckpointReader,
                       writer: ShardWriter, bar: tqdm) -> None:
    group = job.group
    failed: Exception | None = None
    for owner, kind, name in items:
        # An FSDP2-sharded weight is gathered to its owner only, one tensor at a time. Every rank
        # joins every gather, so a rank that failed keeps joining and raises after the loop.
        linear = job.modules[name] if kind == "quant" else None
        # A passed-through weight is written from its source bytes: nothing to gather (the same on every rank).
        gather = linear is not None and not linear.weight_quantizer.passes_through
        weight = gather_to_owner(linear.weight, owner) if gather else None
        rewritten = kind == "copy" and name in job.qplan.rewritten
        if kind == "decoded" or rewritten:
            weight = gather_to_owner(_model_tensor(job, name), owner)
        if owner != group.rank or failed is not None:
            continue
        try:
            if rewritten:  # a calibrator changed it in the model (awq's fold): the model's value, the source dtype
                writer.add(name, weight.detach().to(reader.inventory()[name][0]).contiguous())
            elif kind == "copy":
                writer.add(name, reader.get(name))
            elif kind == "carried":
                info = job.info
                writer.add(name, carried_value(name, job.carried[name], info.carried_decode, reader.get,
                                               info.carried_dtype).contiguous())
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


def _model_tensor(job: _ExportJob, name: str) -> torch.Tensor:
    """The model's tensor of checkpoint key ``name`` (a dense module's parameter: its name is the key)."""
    module, _, attr = name.rpartition(".")
    if module not in job.modules or not isinstance(getattr(job.modules[module], attr, None), torch.Tensor):
        raise KeyError(f"the export writes {name} from the model, which has no such tensor")
    return getattr(job.modules[module], attr)


def _write_experts(job: _ExportJob, writer: ShardWriter, bar: tqdm,
                   modules: dict[str, nn.Module] | None = None) -> None:
    for name, experts in (job.experts_modules if modules is None else modules).items():
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
    refuse_unservable(tmp, info.checkpoint, "the export")  # the serving rules its files decide, before publishing


class ExportInParts:
    """``export_checkpoint`` one part at a time (a layerwise run): ``write_part`` writes what lies under a
    decoder layer (the same items, owners and tensors as a whole export) into that layer's own shard files
    while the layer is loaded; ``publish`` links those files into the export's staging directory, writes
    the rest and the index, and publishes the directory as ``export_checkpoint`` does."""

    def __init__(self, model: nn.Module, qplan: QuantPlan, export_dir: Path, *, format: ExportFormat, group,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = True) -> None:
        self.fmt = format  # the run's resolved format (``RunPlan.export_format``): no name is resolved here
        self.export_dir = Path(export_dir)
        _check_exportable(qplan, self.export_dir, self.fmt)
        self.group = group
        info = qplan.load
        self.job = _ExportJob(model, qplan, self.fmt, self.group)
        if qplan.recipe.kv_cache is not None:  # the sites, not attached quantizers: layers attach theirs later
            names = {id(m): n for n, m in self.job.modules.items()}
            self.job.kv_scales = {f"{names[id(site.attention)]}.{key}": site.attention
                                  for site in self.job.spec.quant.kv_cache_sites(model) for key in site.scale_names}
        self.max_shard_bytes, self.progress = max_shard_bytes, progress
        with info.source() as reader:
            items = _dense_items(qplan, reader, re.compile(self.job.spec.experts.key_regex), self.job.kv_scales,
                                 info.decoded_dense, self.job.carried)
        self.items = with_owners(items, self.group.world_size)

    def write_part(self, prefix: str, out_dir: Path, shard_prefix: str) -> tuple[dict[str, str], int]:
        """This rank's share of everything under module ``prefix``, into ``out_dir/{shard_prefix}-r…``; returns
        its key -> file map and bytes (call on every rank: an FSDP2 gather would be collective)."""
        items = [it for it in self.items if is_under(it[2], prefix)]
        experts = {n: m for n, m in self.job.experts_modules.items() if is_under(n, prefix)}
        return self._write(items, experts, out_dir, shard_prefix, prefix)

    def write_outside(self, layers: tuple[str, ...], out_dir: Path, shard_prefix: str) -> tuple[dict[str, str], int]:
        """This rank's share of everything outside the decoder ``layers``."""
        items = [it for it in self.items if not under_any(it[2], layers)]
        experts = {n: m for n, m in self.job.experts_modules.items() if not under_any(n, layers)}
        return self._write(items, experts, out_dir, shard_prefix, "outside the layers")

    def publish(self, parts: list[tuple[Path, dict[str, str], int]], *, overwrite: bool = False) -> Path:
        """The export of ``parts`` ((directory, key -> file map, tensor bytes) of each part this rank wrote):
        their files hard-linked (else copied) into the staging directory, the index and configs; published
        atomically as ``export_checkpoint`` does (call on every rank)."""
        job = self.job
        release_decode_workspaces(job.experts_modules.values())

        def assemble(tmp: Path) -> tuple[dict[str, str], int]:
            weight_map: dict[str, str] = {}
            for src_dir, part_map, _ in parts:
                for fname in sorted(set(part_map.values())):
                    _link_or_copy(src_dir / fname, tmp / fname)
                weight_map.update(part_map)
            return weight_map, sum(n for *_, n in parts)

        with atomic_output_dir(self.export_dir, overwrite=overwrite, group=self.group) as tmp:
            weight_map, nbytes = run_together("export write shards", assemble, tmp, group=self.group)
            maps, total = gather_weight_maps(weight_map, nbytes, group=self.group)
            run_together("export index and configs", _write_index_and_configs, job, tmp, maps, total, group=self.group)
        return self.export_dir

    def _write(self, items, experts: dict[str, nn.Module], out_dir: Path, shard_prefix: str,
               what: str) -> tuple[dict[str, str], int]:
        job, group = self.job, self.group
        with job.info.source() as reader, ShardWriter(out_dir, prefix=shard_prefix, rank=group.rank,
                                                      max_shard_bytes=self.max_shard_bytes) as writer:
            mine = [it for it in items if it[0] == group.rank]
            total = len(mine) + (sum(m.num_experts for m in experts.values()) if job.writes_experts else 0)
            bar = tqdm(total=total, desc=f"export {what}", disable=not self.progress, leave=False)
            _write_dense_items(job, items, reader, writer, bar)
            if job.writes_experts:
                _write_experts(job, writer, bar, experts)
            bar.close()
            return writer.close(), writer.total_bytes


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link (the parts stay where a resume finds them), else a copy (another filesystem)."""
    import os
    import shutil

    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
