"""Preflight: every refusal that can be decided before a weight is read, as one list of named checks.

``hf_ptq`` runs ``run_preflight`` on every rank as one agreed step, after the recipe is loaded and
before ``load_pretrained``: on the tiny model it takes well under a second, so what would otherwise
fail after hours of loading and calibration fails in seconds, each with one line that says what to do.
A check is a function of the ``PreflightContext`` that raises ``PreflightError``. ``CHECKS`` lists every
check, in order, explicitly: the feature checks too (the memory plan and wall time from ``memory/preflight.py``,
the serving engines from ``check``), so a library caller of ``run_preflight`` runs the same checks as
``hf_ptq`` whatever it imported (they used to register themselves on import). That is why this module sits
above ``check`` in the layers (docs/ARCHITECTURE.md): it composes the checks of the features below it.

What the checks decide on the way (the spec, the one reader of the headers, the experts' source layout,
the decision table, the distribution plan, the memory estimate) they keep on the context, each decided
once; ``PreflightContext.run_plan`` freezes it into the run's ``RunPlan`` (``run/plan.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoint import CheckpointReader
from ..export.staging import sweep_stale
from ..files.paths import check_writable, refuse_overlap
from ..memory.preflight import memory_plan_fits, predicted_wall_time
from ..recipe import Recipe
from ..spec import ModelSpec
from .plan import PtqConfig, RunPlan
from .planning import plan_distribution, read_source, run_dtype, run_recipe, run_spec

__all__ = ["CHECKS", "PreflightCheck", "PreflightContext", "PreflightError", "run_preflight"]


class PreflightError(ValueError):
    """A run refused before any weight is read; the message says what to do."""


@dataclass
class PreflightContext:
    """What the checks look at, and what they decide on the way (each once; ``run_plan`` freezes it).
    ``config``: the run's settings (a check reads the ones its feature owns)."""

    config: PtqConfig
    checkpoint: Path
    trust_remote_code: bool
    export_format: Any  # the ExportFormat ``config.export_format`` names (resolved once by the caller)
    rank: int = 0
    world_size: int = 1
    device: Any = None  # this rank's torch device (None: CPU), for the distribution plan
    # Decided by the checks, in order ("source checkpoint" first, "memory plan fits" last):
    raw_config: dict | None = None  # config.json
    spec: ModelSpec | None = None
    recipe: Recipe | None = None  # the recipe the config names for this spec ("source checkpoint")
    export_path: Path | None = None  # --export_path, else named after the checkpoint and the recipe
    reader: CheckpointReader | None = None  # the source's headers, read once
    source: Any = None  # source_check.SourceLayout: the routed experts as stored
    table: Any = None  # quant.decisions.DecisionTable, from the headers (no shared-input groups)
    distribution: Any = None  # dist.plan.DistributionPlan (its residency set by the memory check)
    layout: Any = None  # memory.inventory.CheckpointLayout of the same headers
    texts: list[str] | None = None  # calibration texts, loaded once by the data check for the run
    memory: Any = None  # the memory planner's estimate of the run (memory/preflight.py)
    layerwise: Any = None  # run.plan.LayerwiseSettings, None for a resident run
    dtype: Any = None  # the load dtype (``--dtype``, else config.json's), decided with the distribution plan
    notes: list[str] = field(default_factory=list)  # said once by rank 0 (e.g. what was cleaned up)
    cleanup: list[Callable[[], None]] = field(default_factory=list)  # what ``close`` undoes (the export lock)

    def close(self) -> None:
        """Undo what the checks hold for the run (the export path's lock), last first. Idempotent."""
        while self.cleanup:
            self.cleanup.pop()()

    def run_plan(self, **decided: Any) -> RunPlan:
        """The frozen ``RunPlan`` of a passed preflight (``decided``: what the caller decided after it)."""
        missing = [n for n in ("spec", "reader", "source", "table", "distribution", "layout", "memory", "dtype")
                   if getattr(self, n) is None]
        if missing:
            raise RuntimeError(f"the preflight did not decide {', '.join(missing)}: were all its checks run?")
        return RunPlan(self.config, self.checkpoint, self.trust_remote_code, self.export_path, self.export_format,
                       self.raw_config, self.spec, self.reader, self.source, self.layout, self.recipe, self.table,
                       self.distribution, self.memory, self.texts or [], dtype=self.dtype, layerwise=self.layerwise,
                       **decided)


@dataclass(frozen=True)
class PreflightCheck:
    name: str
    run: Callable[[PreflightContext], None]


def run_preflight(ctx: PreflightContext, checks: Sequence[PreflightCheck] | None = None) -> float:
    """Run every check of ``CHECKS`` (or ``checks``) in order; the first refusal raises (``PreflightError``).
    Returns the seconds taken."""
    t0 = time.perf_counter()
    try:
        for check in CHECKS if checks is None else checks:
            check.run(ctx)
    except BaseException:
        ctx.close()  # a refused run holds nothing
        raise
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- the checks


def _source_checkpoint(ctx: PreflightContext) -> None:
    """The run's spec, from config.json (decided here, once). The spec says whether its model class is the
    checkpoint's own code (``LoadingSpec.model_class``)."""
    ctx.raw_config, ctx.spec = run_spec(ctx.checkpoint)
    spec = ctx.spec
    if spec.loading.model_class.remote_code and not ctx.trust_remote_code:
        raise PreflightError(f"{ctx.checkpoint} ships its own modeling code; pass --trust_remote_code if you trust it")
    # The recipe (and the export path it names by default) needs the spec: decided here, with it.
    ctx.recipe = run_recipe(ctx.config, spec)
    ctx.export_path = ctx.config.export_path or Path(f"{ctx.checkpoint.name}-{Path(ctx.recipe.name).name}")


def _not_the_source(ctx: PreflightContext) -> None:
    refuse_overlap(ctx.checkpoint, ctx.export_path)


def _checkpoint_matches_config(ctx: PreflightContext) -> None:
    """The shared source check (``source_check.check_experts``, headers only), as load and the converter run it.
    The reader made here is the run's one reader of the source (its headers are never read again)."""
    ctx.reader, ctx.source = read_source(ctx.checkpoint, ctx.raw_config, ctx.spec)


def _export_path_free(ctx: PreflightContext) -> None:
    from ..export.writer import refuse_replacing_a_non_checkpoint

    path = ctx.export_path
    if path.is_dir() and any(path.iterdir()) and not ctx.config.overwrite:
        raise PreflightError(f"--export_path {path} exists and is not empty; pass --overwrite to replace it "
                             "(only once the new export is complete), or choose another path")
    if ctx.config.overwrite:
        try:
            refuse_replacing_a_non_checkpoint(path.absolute())
        except FileExistsError as e:
            raise PreflightError(f"--export_path --overwrite: {e}") from None


def _export_path_writable(ctx: PreflightContext) -> None:
    check_writable(ctx.export_path)


def _stale_temp_data(ctx: PreflightContext) -> None:
    """Remove what dead runs left next to the export path (rank 0); refuse if a live run writes there."""
    notes = sweep_stale(ctx.export_path) if ctx.rank == 0 else []
    ctx.notes += notes
    live = [n for n in notes if "may still be writing" in n]
    if live:
        raise PreflightError(f"another run is exporting to {ctx.export_path}: {live[0]}; wait for it, or choose "
                             "another --export_path")
    if ctx.rank == 0:
        _lock_export_path(ctx)


def _lock_export_path(ctx: PreflightContext) -> None:
    """Rank 0 holds the export path's lock (``files.locks.acquire_export_lock``) from here to the end of the run
    (``ctx.close``), so two runs to one path cannot both pass the preflight."""
    from ..files.locks import LockHeld, acquire_export_lock

    try:
        acquire_export_lock(ctx.export_path, ctx.cleanup, ctx.notes)
    except LockHeld as e:
        raise PreflightError(f"another run is exporting to {ctx.export_path}: {e}") from None


def _export_format(ctx: PreflightContext) -> None:
    """The recipe against the checkpoint's modules (the run's decision table, from headers, decided here
    once), and what the export format can hold."""
    from ..quant.decisions import run_table

    # Shared-input groups need the model's code: quantize adds them to this table (``with_shared_groups``).
    ctx.table = run_table(ctx.reader.inventory(), ctx.spec, ctx.recipe, ctx.source.carried)
    fmt = ctx.export_format  # the ExportFormat the caller resolved from the flag, once
    why = fmt.unexpressible(set(ctx.table.layer_algos().values()), ctx.recipe.kv_cache)
    if why is not None:
        raise PreflightError(f"--export_format {fmt}: {why}; use --export_format modelopt")


def _calibration_reaches(ctx: PreflightContext) -> None:
    """A recipe that needs activations of modules a text forward never runs (a vision tower) would fail only
    after calibration ("no calibration data reached"): refused here, naming them."""
    import re

    spec = ctx.spec
    if spec.quant.uncalibrated_module_regex is None:
        return
    unreachable = re.compile(spec.quant.uncalibrated_module_regex)
    bad = sorted(name for name, d in ctx.table.decisions.items()
                 if d.quantized and d.format.needs_calibration and unreachable.search(name))
    if bad:
        raise PreflightError(
            f"recipe {ctx.recipe.name} quantizes the inputs of {len(bad)} module(s) that text calibration never "
            f"runs, e.g. {bad[0]}; keep them BF16 (enable: false), give them weight-only formats or a constant "
            "input_amax"
        )


def _calibration_data(ctx: PreflightContext) -> None:
    from ..data import DataError, load_texts, read_budget

    cfg = ctx.config
    tokens = (cfg.calib_size + cfg.held_out_asked) * cfg.calib_seq  # as "calibration size" bounds them
    try:
        ctx.texts = load_texts(cfg.dataset, max_chars=read_budget(tokens))  # read no further than the tokens need
    except DataError as e:
        raise PreflightError(f"--dataset {ctx.config.dataset}: {e}") from None


# Files one of which every Hugging Face tokenizer directory holds.
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
# Share of host memory the calibration token ids may take (they are held for the whole calibration).
CALIB_MEMORY_SHARE = 0.25


def _tokenizer_present(ctx: PreflightContext) -> None:
    if not any((ctx.checkpoint / name).is_file() for name in TOKENIZER_FILES):
        raise PreflightError(f"{ctx.checkpoint} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); calibration "
                             "tokenizes its texts with the checkpoint's own tokenizer: copy its tokenizer files there")


def _calibration_size(ctx: PreflightContext) -> None:
    """The token ids of ``(--calib_size + --eval_kl) x --calib_seq`` are held in memory (8 bytes each, twice
    while they are cut): refused when that passes a quarter of this host's memory, before any is made."""
    args = ctx.config
    _calib_seq_within_positions(ctx)
    held_out = args.held_out_asked  # every flag that adds sequences
    sequences = args.calib_size + held_out
    need = sequences * args.calib_seq * 8 * 2
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > CALIB_MEMORY_SHARE * host:
        raise PreflightError(
            f"--calib_size {args.calib_size} (+ {held_out} held out: --report_heldout/--eval_kl) x --calib_seq {args.calib_seq} "
            f"tokens need {need / 2**30:.1f} GiB for their ids alone, more than {CALIB_MEMORY_SHARE:.0%} of this "
            f"host's {host / 2**30:.0f} GiB; lower --calib_size (repeating data adds nothing to max calibration)"
        )


def _calib_seq_within_positions(ctx: PreflightContext) -> None:
    """``--calib_seq`` beyond the model's ``max_position_embeddings`` calibrates on positions it never serves
    (and rotary tables it was not trained on): refused."""
    raw = ctx.raw_config
    if raw is None:
        return  # named by the source check
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    limit = text.get("max_position_embeddings")
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < ctx.config.calib_seq:
        raise PreflightError(f"--calib_seq {ctx.config.calib_seq} is longer than the model's max_position_embeddings "
                             f"= {limit} (config.json); choose --calib_seq <= {limit}")


def _distribution_plan(ctx: PreflightContext) -> None:
    """The run's ``DistributionPlan`` for this rank (``decide_plan``: refuses what cannot work), decided here,
    once; the memory check then sets its experts residency."""
    ctx.dtype = run_dtype(ctx.config, ctx.raw_config)  # once, for every stage
    ctx.distribution = plan_distribution(ctx.config, ctx.spec, ctx.raw_config, rank=ctx.rank,
                                         world_size=ctx.world_size, device=ctx.device, dtype=ctx.dtype)


def _layerwise(ctx: PreflightContext) -> None:
    """``--layerwise`` (or the recipe's ``algorithm.layerwise``), decided once; refused where a layerwise run
    cannot do what was asked: FSDP2-sharded layers, a resume directory inside the source or the export. The
    held-out passes and the report stream with the layers (``layerwise/heldout.py``)."""
    from ..files.paths import refuse_overlap
    from .plan import layerwise_settings

    cfg = ctx.config
    try:
        ctx.layerwise = layerwise_settings(cfg, ctx.recipe)
    except ValueError as e:
        raise PreflightError(str(e)) from None
    if ctx.layerwise is None:
        return
    why = ctx.distribution.layerwise_refusal()
    if why is not None:
        raise PreflightError(why)
    ckpt = ctx.layerwise.checkpoint_dir
    if ckpt is not None:
        refuse_overlap(ctx.checkpoint, ckpt, flag="--layerwise_checkpoint_dir")
        export = Path(ctx.export_path).absolute().resolve()
        here = Path(ckpt).absolute().resolve()
        if here == export or export in here.parents or here in export.parents:
            raise PreflightError(f"--layerwise_checkpoint_dir {ckpt} overlaps the export path {ctx.export_path}; "
                                 "choose a directory beside it")


def _serving_engines(ctx: PreflightContext) -> None:
    """hf_ptq's ``--target_engines``: the recipe against each named engine's rules (names and headers only)."""
    from ..check import EngineRefusal, check_recipe_for_engines

    engines = ctx.config.target_engines
    if not engines:
        return
    fmt = ctx.export_format  # the ExportFormat hf_ptq resolved, once
    if not fmt.engine_checked:
        raise PreflightError(f"--target_engines replays the engines' ModelOpt loaders, not {fmt}'s; "
                             "it needs --export_format modelopt")
    try:
        check_recipe_for_engines(ctx.checkpoint, ctx.recipe, engines, reader=ctx.reader, table=ctx.table,
                                 config=ctx.raw_config, spec=ctx.spec)
    except EngineRefusal as e:
        raise PreflightError(str(e)) from None


# Every check, in the order it runs: each one reads what the ones before it decided (the spec and recipe
# first; the memory plan after the distribution plan and the layerwise choice it sizes). The cheap refusals
# about files and flags come before the ones that read data (the calibration texts) or plan memory.
CHECKS: tuple[PreflightCheck, ...] = (
    PreflightCheck("source checkpoint", _source_checkpoint),
    PreflightCheck("export path is not the source", _not_the_source),
    PreflightCheck("checkpoint matches config.json", _checkpoint_matches_config),
    PreflightCheck("export path free", _export_path_free),
    PreflightCheck("export path writable", _export_path_writable),
    PreflightCheck("no other run exports here", _stale_temp_data),
    PreflightCheck("export format", _export_format),
    PreflightCheck("serving engines", _serving_engines),
    PreflightCheck("calibration reaches every calibrated module", _calibration_reaches),
    PreflightCheck("calibration data", _calibration_data),
    PreflightCheck("distribution plan", _distribution_plan),
    PreflightCheck("layerwise", _layerwise),
    PreflightCheck("memory plan fits", memory_plan_fits),
    PreflightCheck("wall time", predicted_wall_time),
    PreflightCheck("tokenizer present", _tokenizer_present),
    PreflightCheck("calibration size", _calibration_size),
)
