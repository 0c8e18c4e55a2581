"""Layerwise streaming calibration under expert parallelism (``--layerwise``; issue 28).

The model is built on meta; the part outside the decoder layers is read at once (``load.LayerwiseLoad``).
Then, for each decoder layer in order, every rank reads only that layer's tensors it owns, attaches its
quantizers, runs its calibration batches through it (``replay.LayerReplay``: the model's own forward,
earlier layers skipped, this one replayed on the inputs captured for it; tokens reach expert owners by
``torch_a2a`` as in a resident run), calibrates the layer (the recipe's calibrator, scoped to it), writes
the layer's exported tensors (``export.ExportInParts``: the same items, owners and bytes as a resident
export) and releases it. The captured inputs of the next layer are kept per rank, in host memory up to a
limit, then spilled. With ``--layerwise_checkpoint_dir`` each completed layer is committed per rank
(``state.py``) and a rerun resumes at the first incomplete one.

Max calibration with unquantized propagation (its default) gives a resident run's export byte for byte:
each layer sees the unquantized model's activations, the same batches in the same order.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from ..dist.collectives import all_reduce_max_, run_together
from ..dist.group import current_group
from ..experts.packed import release_decode_workspaces
from ..export.model_export import ExportInParts
from ..load import LayerwiseLoad, LoadScope
from ..quant.api import attach_quantizers, start_quantization
from ..quant.calibrators import calibrator_for
from ..quant.coverage import check_coverage, expert_coverage
from ..quant.modules import iter_quantizers
from ..run.plan import LayerwiseSettings, RunPlan
from ..spec.names import is_under
from .replay import InputCache, LayerReplay
from .state import LayerRecord, RankDir, ResumeError, digest, held, producer, source_digest, tokens_digest

__all__ = ["LayerwiseSettings", "ResumeError", "run_layerwise"]

CACHE_LIMIT_ENV = "MODELOPT_K3_LAYERWISE_CACHE_MIB"
DEFAULT_CACHE_LIMIT_MIB = 4096


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


def _scoped_groups(groups: dict[str, tuple[str, ...]], rename) -> dict[str, tuple[str, ...]]:
    """Shared-input groups whose members all lie in a scope, named as the scope names them."""
    out = {}
    for g, members in groups.items():
        names = [rename(m) for m in members]
        if all(n is not None for n in names):
            out[g] = tuple(names)
    return out


@contextmanager
def _modes(module: nn.Module, mode: str):
    """Every quantizer under ``module`` in ``mode`` for the block, then back as it was."""
    saved = [(q, q.mode) for _, q in iter_quantizers(module)]
    for q, _ in saved:
        q.mode = mode
    try:
        yield
    finally:
        for q, m in saved:
            q.mode = m


def _free_quantizer_copies(module: nn.Module) -> None:
    """What a layer's quantizers hold only for its export (GPTQ's updated weight, searched block scales,
    cached fake-quant weights): dropped once the layer is written."""
    for _, q in iter_quantizers(module):
        q.updated_weight = None
        q.block_scale = None
        q._fake_cache = None


def _quant_state(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{name}.amax": q.amax for name, q in iter_quantizers(module)}


def run_layerwise(plan: RunPlan, batches: list[torch.Tensor], *, progress: bool = True, say=print) -> Path:
    """Calibrate and export ``plan`` one decoder layer at a time on this rank's ``batches``; returns the export."""
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
            return _run(plan, batches, settings, Path(root), group, progress, say)
    finally:
        if temporary:
            shutil.rmtree(root, ignore_errors=True)


def _run(plan: RunPlan, batches, settings: LayerwiseSettings, root: Path, group, progress: bool, say) -> Path:
    loader = LayerwiseLoad(plan, progress=progress, hash_reads=settings.checkpoint_dir is not None)
    outside_reads = loader.take_reads()  # read at every start: the "rest" record keeps the ones it was written from
    model, layers = loader.model, loader.layers
    device = loader.info.plan.device
    qplan = start_quantization(model, plan.recipe, plan.table)
    model.modelopt_k3_quant = qplan  # the export and the coverage guard read it; calibration fills its labels
    exporter = ExportInParts(model, plan.export_path, format=plan.export_format,
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
    limit = int(os.environ.get(CACHE_LIMIT_ENV, DEFAULT_CACHE_LIMIT_MIB)) * 2**20
    try:
        for record in work.state.layers:
            replay.metas[record.index] = record.output_meta
            loader.skip_layer(layers[record.index])
        if done < len(layers):
            cache = _first_inputs(replay, batches, work, done, limit)
            for i in range(done, len(layers)):
                cache = _calibrate_layer(i, plan, model, loader, replay, exporter, work, qplan, batches, cache,
                                         settings, limit, outside, progress, outside_reads)
                say(f"[modelopt_k3] layerwise: layer {i + 1}/{len(layers)} done")
    finally:
        replay.restore()
    loader.finish()
    work.verify()  # nothing reaches the export that does not match what was committed
    parts = [(work.path, r.weight_map, r.nbytes) for r in work.records()]
    return exporter.publish(parts, overwrite=plan.config.overwrite)


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


def _calibrate_layer(i: int, plan: RunPlan, model: nn.Module, loader: LayerwiseLoad, replay: LayerReplay,
                     exporter: ExportInParts, work: RankDir, qplan, batches, cache: InputCache,
                     settings: LayerwiseSettings, limit: int, outside: LoadScope, progress: bool,
                     outside_reads: tuple[dict, dict]) -> InputCache:
    name = loader.layers[i]
    last = i == len(loader.layers) - 1
    layer = model.get_submodule(name)
    loader.read_layer(name)
    reads = loader.take_reads()
    scope = LoadScope((name,))
    attach_quantizers(model, qplan, within=scope.holds)
    replay.current = i
    next_cache = InputCache(work.path, limit, f"{i + 1:05d}")

    def replay_all(into: InputCache | None) -> None:
        replay.capture = into is not None
        for b, batch in enumerate(batches):
            out = replay.step(batch, cache[b])
            if into is not None:
                into.append(out)

    def forward_loop(_module: nn.Module) -> None:
        # The first pass runs the unquantized layer (inputs observed, weights off): with unquantized
        # propagation it captures the next layer's inputs on the way; later passes (weight algorithms) do not.
        first = not settings.qdq_inputs and not last and len(next_cache) == 0
        replay_all(next_cache if first else None)

    prefix = f"{name}."
    _calibrate_scope(qplan, layer, forward_loop,
                     lambda m: m[len(prefix):] if m.startswith(prefix) else None, lambda q: prefix + q)
    if not last and len(next_cache) == 0:  # quantized propagation, or no pass needed data
        if settings.qdq_inputs:
            replay_all(next_cache)
        else:
            with _modes(layer, "off"):
                replay_all(next_cache)
    rest = None
    if last:
        rest = _calibrate_outside(plan, model, qplan, outside, replay_all, layer, settings, work, exporter)
        rest.source, rest.source_files = outside_reads
    _coverage_guard(plan, model, name)
    weight_map, nbytes = exporter.write_part(name, work.path, f"layer{i:05d}")
    record = LayerRecord(i, weight_map, nbytes, replay.metas[i], source=reads[0], source_files=reads[1])
    _free_quantizer_copies(layer)
    release_decode_workspaces(m for n, m in loader.info.spec.experts_modules(model).items() if scope.holds(n))
    loader.release_layer(name)
    cache.discard()
    items = [next_cache[b] for b in range(len(next_cache))] if not last else None
    work.commit(record, _quant_state(layer, name), items, rest)
    return next_cache


def _calibrate_scope(qplan, module: nn.Module, forward_loop, rename_member, original_name) -> None:
    """The recipe's calibrator on ``module`` alone; its labels under the model's names."""
    calibrator = calibrator_for(qplan.recipe.algorithm)
    calibrator.calibrate(module, forward_loop, _scoped_groups(qplan.table.groups, rename_member))
    qplan.calibration.update({original_name(k): v for k, v in calibrator.labels.items()})
    qplan.weight_algorithms.update({original_name(k): v for k, v in calibrator.weight_algorithms.items()})


def _calibrate_outside(plan, model, qplan, outside: LoadScope, replay_all, last_layer: nn.Module,
                       settings: LayerwiseSettings, work: RankDir, exporter: ExportInParts) -> LayerRecord:
    """With the last layer: the quantized modules outside the decoder layers (e.g. a quantized ``lm_head``)
    calibrate on the forward's tail, then everything outside the layers is written (the "rest" part)."""
    modules = dict(model.named_modules())
    quantized = {n: modules[n] for n in (*qplan.dense, *qplan.experts) if outside.holds(n)}
    if quantized:
        scope = _Scope(quantized)
        members = {n.replace(".", ":") for n in quantized}

        def rename(m: str) -> str | None:
            return f"parts.{m.replace('.', ':')}" if m.replace(".", ":") in members else None

        def forward_loop(_module: nn.Module) -> None:
            if settings.qdq_inputs:
                replay_all(None)
            else:
                with _modes(last_layer, "off"):
                    replay_all(None)

        _calibrate_scope(qplan, scope, forward_loop, rename, _Scope.original)
    weight_map, nbytes = exporter.write_outside(outside.outside, work.path, "model")
    return LayerRecord(-1, weight_map, nbytes, {})


def _coverage_guard(plan: RunPlan, model: nn.Module, layer: str) -> None:
    """``--min_expert_tokens``/``--uncovered_experts`` for this layer's experts, before it is written."""
    coverage = [c for c in expert_coverage(model, model.modelopt_k3.spec)
                if is_under(c.module, layer)]
    for note in check_coverage(coverage, min_tokens=plan.config.min_expert_tokens,
                               policy=plan.config.uncovered_experts):
        if current_group().is_main:
            print(f"[modelopt_k3] uncovered experts: {note}")
