"""Layerwise streaming calibration under expert parallelism (``--layerwise``; issue 28).

The model is built on meta; the part outside the decoder layers is read at once (``load.LayerwiseLoad``).
Then, for each decoder layer in order, every rank reads only that layer's tensors it owns, attaches its
quantizers, runs its calibration batches through it (``replay.LayerReplay``: the model's own forward,
earlier layers skipped, this one replayed on the inputs captured for it; tokens reach expert owners by
``torch_a2a`` as in a resident run), calibrates the layer (the recipe's calibrator, scoped to it), writes
the layer's exported tensors (``export.ExportInParts``: the same items, owners and bytes as a resident
export) and releases it. The captured inputs of the next layer are kept per rank, in host memory up to a
limit (``LayerwiseSettings.cache_mib``), then spilled. With ``--layerwise_checkpoint_dir`` each completed layer is committed per rank
(``state.py``) and a rerun resumes at the first incomplete one.

Max calibration with unquantized propagation (its default) gives a resident run's export byte for byte:
each layer sees the unquantized model's activations, the same batches in the same order.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..dist.collectives import all_reduce_max_, run_together
from ..dist.group import current_group
from ..experts.packed import release_decode_workspaces
from ..export.model_export import ExportInParts
from ..load import LayerwiseLoad, LoadScope
from ..quant.api import QuantPlan, attach_quantizers, calibrate_scope, start_quantization
from ..quant.coverage import LayerCoverage, guard_coverage
from ..quant.evaluate import Fidelity
from ..quant.modules import iter_quantizers
from ..report.collect import weight_summary
from ..run.plan import LayerwiseSettings, RunPlan
from .heldout import HeldOutStreams, quantizer_modes
from .replay import InputCache, LayerReplay
from .state import LayerRecord, RankDir, ResumeError, digest, held, producer, source_digest, tokens_digest

__all__ = ["LayerwiseResult", "LayerwiseSettings", "ResumeError", "run_layerwise"]


def fingerprint(plan: RunPlan, batches: list[torch.Tensor], qplan) -> dict[str, str]:
    """What a resume must find unchanged (state.py): each field named when it differs."""
    dist = plan.distribution
    return {
        "source checkpoint": source_digest(plan.checkpoint),
        "recipe": digest(plan.recipe.name, str(plan.recipe.algorithm), repr(sorted(qplan.dense.items())),
                         repr(sorted(qplan.experts.items())), repr(sorted(qplan.table.groups.items())),
                         str(plan.recipe.kv_cache), str(plan.recipe.calibrate_all_experts)),
        "world size": str(dist.world_size),
        "plan": digest(dist.describe(), str(dist.experts_residency), str(dist.decode_chunk), str(dist.device.type)),
        "calibration tokens": tokens_digest(batches),
        "export settings": digest(str(plan.export_format), str(plan.config.max_shard_size_mb),
                                  str(plan.layerwise.qdq_inputs)),
        "load dtype": str(plan.dtype),  # bf16- and fp32-calibrated layers never mix in one export
        "producer": producer(),
    }


class _Scope(nn.Module):
    """The quantized modules outside the decoder layers, as one module a calibrator can take (names with
    ``:`` for ``.``, mapped back by ``original``)."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({name.replace(".", ":"): m for name, m in modules.items()})

    @staticmethod
    def original(name: str) -> str:
        head, _, rest = name.removeprefix("parts.").partition(".")
        return head.replace(":", ".") + (f".{rest}" if rest else "")


def _free_quantizer_copies(module: nn.Module) -> None:
    """What a layer's quantizers hold only for its export (GPTQ's updated weight, searched block scales,
    cached fake-quant weights): dropped once the layer is written."""
    for _, q in iter_quantizers(module):
        q.updated_weight = None
        q.block_scale = None
        q._fake_cache = None


def _quant_state(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{name}.amax": q.amax for name, q in iter_quantizers(module)}


@dataclass
class LayerwiseResult:
    """What a layerwise run hands on: the export, and what the quantization report needs, taken layer by layer
    while each was resident (empty for a resumed run: its earlier layers were calibrated by another process)."""

    export: Path
    model: nn.Module  # the model, its layers released: quantizers and counters remain
    qplan: QuantPlan  # the quantization plan (with the load): the report stage takes it
    resumed_at: int = 0  # the first layer this run calibrated (0: every layer; then the fields below are complete)
    weights: dict[str, list] | None = None  # this rank's ``report.collect.weight_summary`` rows (asked for)
    coverage: list[LayerCoverage] = field(default_factory=list)  # the guard's coverage, in layer order
    fidelity: Fidelity | None = None  # the held-out passes' sums over all ranks (held-out batches given)


def run_layerwise(plan: RunPlan, batches: list[torch.Tensor], *, held_out: list[torch.Tensor] | None = None,
                  report: bool = False, progress: bool = True, say=print) -> LayerwiseResult:
    """Calibrate and export ``plan`` one decoder layer at a time on this rank's ``batches``.

    ``held_out``: this rank's held-out batches, streamed through each layer for the original and the quantized
    model (``heldout.py``: the resident ``evaluate_fidelity``'s figures); ``report``: take each layer's weight
    rows for the quantization report before the layer is released. A resumed run takes neither (the layers an
    earlier process calibrated are not re-run) and says so."""
    group = current_group()
    settings: LayerwiseSettings = plan.layerwise
    root = settings.checkpoint_dir
    temporary = root is None
    if temporary:
        parent = Path(plan.export_path).absolute().parent
        parent.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix=f".{Path(plan.export_path).name}.layerwise-", dir=parent))
    try:
        with held(Path(root), group.rank):
            return _run(plan, batches, held_out, report, settings, Path(root), group, progress, say)
    finally:
        if temporary:
            shutil.rmtree(root, ignore_errors=True)


@dataclass
class _Layers:
    """One layerwise run's parts, as every layer's step uses them."""

    plan: RunPlan
    model: nn.Module
    loader: LayerwiseLoad
    replay: LayerReplay
    exporter: ExportInParts
    work: RankDir
    qplan: QuantPlan
    batches: list[torch.Tensor]
    settings: LayerwiseSettings
    limit: int
    outside: LoadScope
    result: LayerwiseResult
    group: object  # the run group: the report rows' gathers
    heldout: HeldOutStreams | None = None
    say: object = print
    outside_reads: tuple[dict, dict] = ({}, {})  # the source reads outside the layers, for the "rest" record


def _run(plan: RunPlan, batches, held_out, report: bool, settings: LayerwiseSettings, root: Path, group,
         progress: bool, say) -> LayerwiseResult:
    loader = LayerwiseLoad(plan, progress=progress, hash_reads=settings.checkpoint_dir is not None)
    outside_reads = loader.take_reads()  # read at every start: the "rest" record keeps the ones it was written from
    model, layers = loader.model, loader.layers
    device = loader.info.plan.device
    qplan = start_quantization(model, loader.info, plan.recipe, plan.table)  # calibration fills its labels
    exporter = ExportInParts(model, qplan, plan.export_path, format=plan.export_format, group=group,
                             max_shard_bytes=plan.config.max_shard_size_mb * 2**20, progress=progress)
    work = RankDir(root, group.rank, fingerprint(plan, batches, qplan))
    done = run_together("layerwise: read the checkpoint", work.load, loader.source_change, group=group)
    done = _agree_on_done(done, group)
    work.roll_back(done)
    if done == len(layers):  # killed after the last commit, before (or while) publishing
        say(f"[modelopt_k3] layerwise: all {len(layers)} layers committed in {root}; publishing the export")
    elif done:
        say(f"[modelopt_k3] layerwise: resuming at layer {done + 1}/{len(layers)} from {root}")
    outside = LoadScope(("",), tuple(layers))
    attach_quantizers(model, qplan, within=outside.holds)
    replay = LayerReplay(model, layers, device)
    limit = settings.cache_bytes  # the plan's (``--layerwise_cache_mib``), decided once
    result = LayerwiseResult(plan.export_path, model, qplan, resumed_at=done,
                             weights=_no_rows() if report and not done else None)
    run = _Layers(plan, model, loader, replay, exporter, work, qplan, batches, settings, limit, outside, result,
                  group, say=say, outside_reads=outside_reads)
    try:
        for record in work.state.layers:
            replay.metas[record.index] = record.output_meta
            loader.skip_layer(layers[record.index])
        if done < len(layers):
            cache = _first_inputs(replay, batches, work, done, limit)
            if held_out and not done:
                run.heldout = HeldOutStreams(model, replay, held_out, work.path, limit)
                run.heldout.capture_first()
            for i in range(done, len(layers)):
                cache = _calibrate_layer(i, run, cache, progress)
                say(f"[modelopt_k3] layerwise: layer {i + 1}/{len(layers)} done")
    finally:
        replay.restore()
    loader.finish()
    work.verify()  # nothing reaches the export that does not match what was committed
    parts = [(work.path, r.weight_map, r.nbytes) for r in work.records()]
    result.export = exporter.publish(parts, overwrite=plan.config.overwrite)
    if run.heldout is not None:
        result.fidelity = run.heldout.result()
    return result


def _no_rows() -> dict[str, list]:
    return {"dense": [], "experts": []}


def _add_rows(result: LayerwiseResult, model: nn.Module, group, within) -> None:
    """The report's weight rows of the modules ``within`` holds, taken while their weights are resident."""
    if result.weights is not None:
        rows = weight_summary(model, result.qplan, group, within)
        for kind in ("dense", "experts"):
            result.weights[kind] += rows[kind]


def _agree_on_done(done: int, group) -> int:
    """The smallest completed count over ranks (a kill between two ranks' commits leaves them one apart)."""
    if group.world_size == 1:
        return done
    both = torch.tensor([done, -done], dtype=torch.float64, device=group.device)
    all_reduce_max_(both, group=group)
    most, least = int(both[0]), -int(both[1])
    if most - least > 1:
        raise ResumeError(f"the ranks' layerwise checkpoints are {least} and {most} layers in: not one run's; "
                          "remove the directory to start over")
    return least


def _first_inputs(replay: LayerReplay, batches, work: RankDir, done: int, limit: int) -> InputCache:
    """Layer ``done``'s inputs: captured now (layer 0: the model's own embedding and masks), or as committed."""
    cache = InputCache(work.path, limit, f"{done:05d}")
    if done:
        for item in work.inputs(done):
            cache.append(item)
        return cache
    replay.current, replay.capture = -1, True
    for batch in batches:
        cache.append(replay.step(batch, None))
    return cache


def _calibrate_layer(i: int, run: _Layers, cache: InputCache, progress: bool) -> InputCache:
    loader, model, replay, work, settings = run.loader, run.model, run.replay, run.work, run.settings
    name = loader.layers[i]
    last = i == len(loader.layers) - 1
    layer = model.get_submodule(name)
    loader.read_layer(name)
    reads = loader.take_reads()
    scope = LoadScope((name,))
    attach_quantizers(model, run.qplan, within=scope.holds)
    replay.current = i
    next_cache = InputCache(work.path, run.limit, f"{i + 1:05d}")

    def replay_all(into: InputCache | None) -> None:
        replay.current, replay.capture = i, into is not None
        for b, batch in enumerate(run.batches):
            out = replay.step(batch, cache[b])
            if into is not None:
                into.append(out)

    def forward_loop(_module: nn.Module) -> None:
        # The first pass runs the unquantized layer (inputs observed, weights off): with unquantized
        # propagation it captures the next layer's inputs on the way; later passes (weight algorithms) do not.
        first = not settings.qdq_inputs and not last and len(next_cache) == 0
        replay_all(next_cache if first else None)

    prefix = f"{name}."
    calibrate_scope(run.qplan, layer, forward_loop, rename=lambda m: m[len(prefix):] if m.startswith(prefix) else None,
                    original=lambda q: prefix + q)
    if not last and len(next_cache) == 0:  # quantized propagation, or no pass needed data
        if settings.qdq_inputs:
            replay_all(next_cache)
        else:
            with quantizer_modes(layer, "off"):
                replay_all(next_cache)
    rest = None
    if last:
        rest = _calibrate_outside(run, replay_all, layer)
        rest.source, rest.source_files = run.outside_reads
    _guard(run, scope.holds)
    weight_map, nbytes = run.exporter.write_part(name, work.path, f"layer{i:05d}")
    record = LayerRecord(i, weight_map, nbytes, replay.metas[i], source=reads[0], source_files=reads[1])
    _add_rows(run.result, model, run.group, scope.holds)  # after the write, as a resident report reads the export
    if run.heldout is not None:
        run.heldout.advance(i)
    _free_quantizer_copies(layer)
    release_decode_workspaces(m for n, m in loader.info.spec.experts_modules(model).items() if scope.holds(n))
    loader.release_layer(name)
    cache.discard()
    items = [next_cache[b] for b in range(len(next_cache))] if not last else None
    work.commit(record, _quant_state(layer, name), items, rest)
    return next_cache


def _calibrate_outside(run: _Layers, replay_all, last_layer: nn.Module) -> LayerRecord:
    """With the last layer: the quantized modules outside the decoder layers (e.g. a quantized ``lm_head``)
    calibrate on the forward's tail, then everything outside the layers is written (the "rest" part)."""
    model, qplan, outside = run.model, run.qplan, run.outside
    modules = dict(model.named_modules())
    quantized = {n: modules[n] for n in (*qplan.dense, *qplan.experts) if outside.holds(n)}
    if quantized:
        scope = _Scope(quantized)
        members = {n.replace(".", ":") for n in quantized}

        def rename(m: str) -> str | None:
            return f"parts.{m.replace('.', ':')}" if m.replace(".", ":") in members else None

        def forward_loop(_module: nn.Module) -> None:
            if run.settings.qdq_inputs:
                replay_all(None)
            else:
                with quantizer_modes(last_layer, "off"):
                    replay_all(None)

        calibrate_scope(qplan, scope, forward_loop, rename=rename, original=_Scope.original)
    _guard(run, outside.holds)
    weight_map, nbytes = run.exporter.write_outside(outside.outside, run.work.path, "model")
    _add_rows(run.result, model, run.group, outside.holds)
    return LayerRecord(-1, weight_map, nbytes, {})


def _guard(run: _Layers, within) -> None:
    """The one coverage guard (``--min_expert_tokens``/``--uncovered_experts``) on the experts ``within`` holds,
    before they are written; their coverage kept for the report."""
    config = run.plan.config
    run.result.coverage += guard_coverage(run.model, run.plan.spec, min_tokens=config.min_expert_tokens,
                                          policy=config.uncovered_experts, within=within, say=run.say)
