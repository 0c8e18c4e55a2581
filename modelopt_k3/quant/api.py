"""``quantize(model, recipe, forward_loop)``: match the recipe, attach quantizers, calibrate, summarise.

The stage is ``quantize_planned(model, load, recipe, forward_loop, table=...)``: it takes what the load
produced (``load``: the ``LoadInfo``) and the run's decision table, and returns the ``QuantPlan``, which holds
that load; the stages after it (export, report) take the ``QuantPlan``. ``quantize`` is the library's
convenience over the same path: it takes the load off the model ``load_pretrained`` returned and leaves the
plan on it (``model.modelopt_k3_quant``) for ``export_checkpoint`` and ``report`` to take the same way.

Recipe patterns are matched against the checkpoint's own module names: a dense Linear's in-memory
name is its checkpoint name, and a fused experts module is matched as the per-expert Linears it is on
disk (``…experts.{e}.w1`` etc., via the spec's ``ExpertsSpec.projections``).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from ..checkpoint.nonfinite import PASSTHROUGH_FLAG, NonFiniteError
from ..checkpoint.source_decode import dense_decodes
from ..dist.fsdp import local_experts, local_rows, row_gatherer
from ..experts.packed import is_packed
from ..recipe import QuantFormat, Recipe, RecipeError, load_recipe
from ..spec import ModelSpec
from .activation_stats import attach_activation_stats
from .block_fp8_source import BlockFp8Source, block_fp8_passthrough
from .calibrate import enable_calibrate_all_experts
from .calibrators import calibrator_for
from .coverage import attach_token_counter
from .decisions import DecisionTable, run_table, with_shared_groups
from .kv_cache import attach_kv_cache
from .modules import attach_experts, attach_linear
from .mxfp4_source import Mxfp4ExpertSource
from .schemes import TensorFormat
from .shared_inputs import discover_shared_inputs

log = logging.getLogger(__name__)


class LoadFacts(Protocol):
    """What quantization and the stages after it read about the load (``load.LoadInfo`` is one; the load
    layer sits above this one, so it is named by what it holds)."""

    checkpoint: Path
    spec: ModelSpec
    plan: Any  # the DistributionPlan: rank, device, describe()
    placement: Any  # the run's mesh and expert placement
    model_cls: type | None
    packed_experts: bool
    decoded_dense: dict[str, tuple[str, ...]]
    carried: Any  # CarriedModules | None: modules the checkpoint stores but the model does not build
    carried_keys: frozenset[str]
    carried_decode: Any
    carried_dtype: Any
    nonfinite: dict[str, str]
    run: Any  # the RunPlan the model was loaded through, or None

    def source(self) -> Any: ...


@dataclass
class QuantPlan:
    """What quantize decided, per checkpoint module name (views of the decision table); read by the
    summary and the exporter."""

    recipe: Recipe
    table: DecisionTable
    # the load this plan quantizes (its spec, placement, source reader): the stages after quantize take it from
    # here, never off the model
    load: LoadFacts = field(repr=False, compare=False)
    dense: dict[str, QuantFormat] = field(default_factory=dict)
    # experts module name -> projection name -> format (same for every expert of the module)
    experts: dict[str, dict[str, QuantFormat]] = field(default_factory=dict)
    left_bf16: dict[str, str] = field(default_factory=dict)  # module name -> reason
    # weight name (input quantizer name, for an input rule's exceptions) -> what chose its scales; {} under max
    calibration: dict[str, str] = field(default_factory=dict)
    # weight quantizer name -> which algorithm produced its scales (calibrators.weight_algorithm_names());
    # the calibrator's own record, the report's ``weight_algorithm``
    weight_algorithms: dict[str, str] = field(default_factory=dict)
    # dense Linear -> whether its weight is written as its block-FP8 source bytes, or why it is requantized
    # (quant/block_fp8_source.py); the report's ``calibration`` for those Linears
    source_labels: dict[str, str] = field(default_factory=dict)
    # source tensors the calibrator changed in the model (awq's folded norms, router weights): exported from it
    rewritten: set[str] = field(default_factory=set)
    _dense_decodes: dict | None = field(default=None, repr=False)

    def summary(self) -> str:
        counts: Counter[str] = Counter(f.algo for f in self.dense.values())
        for projs in self.experts.values():
            for fmt in projs.values():
                counts[f"{fmt.algo} (experts, per layer+proj)"] += 1
        reasons: Counter[str] = Counter(self.left_bf16.values())
        lines = [f"recipe {self.recipe.name}: algorithm={self.recipe.algorithm} kv_cache={self.recipe.kv_cache}"]
        lines += [f"  {algo:<34} {n:>6} modules" for algo, n in sorted(counts.items())]
        lines.append(f"  {'BF16 (left unquantized)':<34} {len(self.left_bf16):>6} modules")
        lines += [f"    {n:>6}  {reason}" for reason, n in reasons.most_common()]
        if self.table.groups:
            lines.append(f"  {len(self.table.groups)} shared-input groups share weight_scale_2/input_scale")
        for what, inputs in (("weight scales", False), ("input scales", True)):
            labels = Counter(how for name, how in self.calibration.items() if _names_an_input(name) == inputs)
            lines += [f"  {what}: {n:>6} by {how}" for how, n in sorted(labels.items())]
        # A label names its module where it says why (the report keeps it so); counted with the name taken out, a
        # run's ~500 requantized attention projections are one line, not one each.
        sources = Counter(how.replace(name, "<module>") for name, how in self.source_labels.items())
        lines += [f"  source bytes:  {n:>6} {how}" for how, n in sorted(sources.items())]
        return "\n".join(lines)


def _names_an_input(quantizer: str) -> bool:
    """Whether a calibration label's key is an input quantizer (a Linear's ``input_quantizer``, an experts module's
    ``quant.input.<param>``): calibrators label weights by the weight's name, inputs by the quantizer's."""
    return quantizer.endswith(".input_quantizer") or ".quant.input." in quantizer


def _tied_elsewhere(model: nn.Module, name: str, linear: nn.Linear) -> bool:
    """``linear``'s weight is another module's parameter (``tie_word_embeddings``: a ``lm_head`` the checkpoint
    does not store is the embedding, as transformers loads it): it has no tensor of its own to quantize or
    export, and the export's config keeps the tie."""
    own = f"{name}.weight"
    return any(p is linear.weight and n != own for n, p in model.named_parameters(remove_duplicate=False))


def _check_modules_match(model: nn.Module, table: DecisionTable, spec: ModelSpec, carried) -> None:
    """The table classifies the checkpoint's tensors; the model's own Linears must be the same set.
    ``carried``: modules the model does not build (MTP layers): kept, never matched."""
    held = (lambda name: False) if carried is None else carried.holds
    table_linears = {name for name in table.of_kind("linear") if not held(name)}
    routers = set(table.of_kind("router"))  # a router built as a Linear (Qwen3.5-MoE's shared_expert_gate)
    linears = {name for name, m in model.named_modules() if type(m) is nn.Linear and name not in routers
               and (name in table_linears or not _tied_elsewhere(model, name, m))}
    experts = set(spec.experts_modules(model))
    table_experts = {name.rpartition(".*.")[0] for name in table.of_kind("experts") if not held(name)}
    if linears != table_linears or experts != table_experts:
        diff = sorted((linears ^ table_linears) | (experts ^ table_experts))
        raise RuntimeError(f"the checkpoint's Linears and the model's disagree on {len(diff)} module(s), e.g. {diff[:5]}")


def planned_table(info: LoadFacts, recipe: Recipe) -> DecisionTable:
    """``quantize(table=None)``'s table: the one the load's plan made (``LoadInfo.run``: ``load_pretrained`` and
    hf_ptq load through a ``RunPlan``) when it is for ``recipe``, else ``run_table`` -- the builder that plan
    used -- on the load's reader and carried modules. Never a decision of its own."""
    run = info.run
    if run is not None and run.recipe == recipe:
        return run.table
    return run_table(info.source().inventory(), info.spec, recipe, info.carried)


def plan_quantization(model: nn.Module, info: LoadFacts, recipe: Recipe,
                      table: DecisionTable | None = None) -> QuantPlan:
    """The quantization plan of ``model`` as ``info`` loaded it: ``table`` (the run's, decided by the preflight
    from the headers), else ``planned_table``'s, with its shared-input groups."""
    spec = info.spec
    # The probe runs only when a dense Linear gets a format whose groups share scales (NVFP4, per-tensor FP8).
    rules = (lambda: discover_shared_inputs(spec, info.model_cls, model.config)) if spec.quant.probe_model else None
    if table is None:
        table = planned_table(info, recipe)
        recipe = table.recipe  # equal to the one asked: the table's own object
    elif table.recipe is not recipe:
        raise ValueError(f"the decision table is for recipe {table.recipe.name}, not {recipe.name}")
    table = with_shared_groups(table, rules)
    table.check_groups_known()
    _check_modules_match(model, table, spec, info.carried)
    plan = QuantPlan(recipe, table, info)
    for name, d in table.decisions.items():
        if d.kind == "linear" and d.quantized:
            plan.dense[name] = d.format
        elif d.kind == "experts" and d.quantized:
            module, _, proj = name.rpartition(".*.")
            plan.experts.setdefault(module, {})[proj] = d.format
        elif d.kind in ("linear", "experts"):
            plan.left_bf16[name] = d.reason
    return plan


def _refuse_quantizing_nonfinite(qplan: QuantPlan, nonfinite: dict[str, str], spec: ModelSpec) -> None:
    """Source tensors let through with NaN/Inf (``allow_nonfinite_passthrough``) may only stay unquantized."""
    expert_re = re.compile(spec.experts.key_regex)
    bad = {}
    for key, what in nonfinite.items():
        m = expert_re.match(key)
        quantized_expert = m is not None and m["proj"] in qplan.experts.get(m["module"], {})
        if quantized_expert or key.rpartition(".")[0] in qplan.dense:
            bad[key] = what
    if bad:
        raise NonFiniteError(
            f"recipe {qplan.recipe.name} quantizes tensors that hold values that are not numbers", bad,
            f"{PASSTHROUGH_FLAG} only passes tensors that stay unquantized; fix the checkpoint or leave "
            "these modules unquantized in the recipe",
        )


def _fused_formats(
    spec: ModelSpec, projs: dict[str, QuantFormat]
) -> dict[str, tuple[TensorFormat | None, TensorFormat | None, float | None]]:
    """fused param -> (weight fmt, input fmt, constant input amax), from per-projection formats."""
    out: dict[str, tuple[TensorFormat | None, TensorFormat | None, float | None]] = {}
    for proj in spec.experts.projections:
        fmt = projs.get(proj.name)
        value = (fmt.weights, fmt.inputs, fmt.input_amax) if fmt is not None else (None, None, None)
        if proj.fused_param in out and out[proj.fused_param] != value:
            raise RecipeError(f"projections fused into {proj.fused_param} need one format, got {out[proj.fused_param]} and {value}")
        out[proj.fused_param] = value
    return out


def start_quantization(model: nn.Module, info: LoadFacts, recipe: Recipe | str,
                       table: DecisionTable | None = None) -> QuantPlan:
    """The quantization plan of a loaded model (``quantize_planned``'s first step; a layerwise run takes it
    once, then attaches and calibrates layer by layer): nothing is attached yet."""
    if isinstance(recipe, str):
        recipe = load_recipe(recipe)
    qplan = plan_quantization(model, info, recipe, table)
    if recipe.kv_cache is not None and info.spec.quant.kv_cache_sites is None:
        raise RecipeError(f"recipe {recipe.name} asks for kv_cache={recipe.kv_cache}, "
                          f"which model_type {info.spec.model_type} does not support")
    if recipe.kv_cache is not None and not info.spec.quant.kv_cache_sites(model):
        attach_kv_cache([], recipe.kv_cache)  # refuses: the model declares no site
    return qplan


def attach_quantizers(model: nn.Module, qplan: QuantPlan, within: Callable[[str], bool] | None = None) -> None:
    """Attach ``qplan``'s quantizers to the modules ``within`` holds (default: all), their weights loaded:
    a weight's amax is taken from it here. Layer by layer, each part is attached once."""
    info = qplan.load
    spec: ModelSpec = info.spec
    holds = within or (lambda name: True)
    _refuse_quantizing_nonfinite(qplan, info.nonfinite, spec)
    modules = dict(model.named_modules())
    for name, fmt in qplan.dense.items():
        if holds(name):
            attach_linear(modules[name], fmt.weights, fmt.inputs, fmt.input_amax)
            if fmt.weights.holds_block_fp8 is not None:
                _use_block_fp8_source(model, qplan, name, modules[name])
    for name, projs in qplan.experts.items():
        if not holds(name):
            continue
        experts = modules[name]
        source = None
        if info.packed_experts:
            # Only the experts this rank holds (its EP block or FSDP2 rows); scales gathered when sharded.
            fused = getattr(experts, next(iter(spec.experts.sharded_params)))
            # Packed-resident experts already hold these bytes: the cast reads them, not the checkpoint.
            source = Mxfp4ExpertSource(info.source(), spec, name, local_experts(experts, spec),
                                       rows=local_rows(fused), gather=row_gatherer(fused),
                                       resident=experts if is_packed(experts) else None)
        attach_experts(experts, _fused_formats(spec, projs), source=source)
        attach_token_counter(experts)  # calibration tokens per expert: the report's coverage and its guard
    recipe = qplan.recipe
    if recipe.kv_cache is not None:
        names = {id(m): n for n, m in modules.items()}
        sites = [site for site in spec.quant.kv_cache_sites(model) if holds(names[id(site.attention)])]
        if sites or within is None:
            attach_kv_cache(sites, recipe.kv_cache)
    if recipe.calibrate_all_experts:
        enable_calibrate_all_experts(model)  # experts not yet so (idempotent)
    attach_activation_stats(model)  # input quantizers without a counter (idempotent)


def _use_block_fp8_source(model: nn.Module, qplan: QuantPlan, name: str, module: nn.Linear) -> None:
    """Write ``name``'s weight as its block-FP8 source bytes where its format holds them (the converter's
    decision, ``block_fp8_passthrough``), recording the label either way."""
    info = qplan.load
    reader = info.source()
    if qplan._dense_decodes is None:  # once per run: a layerwise run attaches layer by layer
        qplan._dense_decodes = dense_decodes(reader, info.spec.loading.dense_converters)
    where, label = block_fp8_passthrough(name, qplan.dense[name].weights, qplan.table.decisions[name].shape,
                                         qplan._dense_decodes, reader.headers(), model.config)
    if where is not None:
        module.weight_quantizer.block_source = BlockFp8Source(reader, where, module.weight.dtype)
    qplan.source_labels[name] = label


def scoped_groups(groups: dict[str, tuple[str, ...]],
                  rename: Callable[[str], str | None]) -> dict[str, tuple[str, ...]]:
    """Shared-input groups whose members all lie in a scope (``rename``: a member's name in the scope, None
    outside it), named as the scope names them."""
    out = {}
    for g, members in groups.items():
        names = [rename(m) for m in members]
        if all(n is not None for n in names):
            out[g] = tuple(names)
    return out


def calibrate_scope(qplan: QuantPlan, module: nn.Module, forward_loop: Callable[[nn.Module], None] | None, *,
                    calibrator=None, rename: Callable[[str], str | None] | None = None,
                    original: Callable[[str], str] | None = None) -> None:
    """Calibrate-and-record, the one step ``quantize`` (the whole model) and a layerwise run (one layer, or the
    modules outside the layers) share: the recipe's calibrator on ``module`` with the shared-input groups
    inside it, then its labels and weight algorithms recorded in ``qplan`` under the model's names.

    ``rename``: a model name -> its name inside ``module`` (None: outside); ``original``: the reverse, for
    the calibrator's labels. Both default to the identity (``module`` is the model)."""
    calibrator = calibrator or calibrator_for(qplan.recipe.algorithm)
    calibrator.load = qplan.load if rename is None else None  # the run's load: only for the whole model
    groups = qplan.table.groups if rename is None else scoped_groups(qplan.table.groups, rename)
    calibrator.calibrate(module, forward_loop, groups)
    original = original or (lambda name: name)
    qplan.calibration.update({original(k): v for k, v in calibrator.labels.items()})
    qplan.weight_algorithms.update({original(k): v for k, v in calibrator.weight_algorithms.items()})
    qplan.rewritten |= {original(k) for k in calibrator.rewritten}  # tensors a calibrator changed (AWQ's folds)


def quantize_planned(
    model: nn.Module,
    info: LoadFacts,
    recipe: Recipe | str,
    forward_loop: Callable[[nn.Module], None] | None = None,
    *,
    table: DecisionTable | None = None,
    verbose: bool = True,
) -> QuantPlan:
    """The quantize stage: attach quantizers per ``recipe`` to ``model`` as ``info`` loaded it, calibrate with
    ``forward_loop`` (the calibrator ``recipe.algorithm`` names, quant/calibrators); returns the plan the
    export and the report take. ``table``: the run's decision table for ``recipe`` (``RunPlan.table``), else
    the load's plan's (``planned_table``): no second decision."""
    qplan = start_quantization(model, info, recipe, table)
    calibrator = calibrator_for(qplan.recipe.algorithm)  # its options checked before any quantizer is attached
    attach_quantizers(model, qplan)
    calibrate_scope(qplan, model, forward_loop, calibrator=calibrator)
    if verbose and info.plan.rank == 0:
        print(qplan.summary())
    return qplan


def loaded_facts(model: nn.Module) -> LoadFacts:
    """The load a library call takes off a model ``load_pretrained`` returned (``model.modelopt_k3``)."""
    info = getattr(model, "modelopt_k3", None)
    if info is None:
        raise ValueError("quantize expects a model from modelopt_k3.load_pretrained (it needs the spec and plan)")
    return info


def quantized_plan(model: nn.Module, what: str) -> QuantPlan:
    """The plan a library call (``export_checkpoint``, ``report``) takes off a model ``quantize`` returned."""
    qplan = getattr(model, "modelopt_k3_quant", None)
    if getattr(model, "modelopt_k3", None) is None or qplan is None:
        raise ValueError(f"{what} expects a model from load_pretrained that went through quantize")
    return qplan


def quantize(
    model: nn.Module,
    recipe: Recipe | str,
    forward_loop: Callable[[nn.Module], None] | None = None,
    *,
    verbose: bool = True,
    table: DecisionTable | None = None,
) -> nn.Module:
    """Attach quantizers per ``recipe``, calibrate with ``forward_loop`` (the calibrator ``recipe.algorithm``
    names, quant/calibrators), return ``model``: the library's ``quantize_planned`` on the load
    ``load_pretrained`` left on the model, with the plan left on it for ``export_checkpoint`` and ``report``.

    ``forward_loop(model)`` runs this rank's share of the calibration data through the model; it may
    be None when the recipe needs no activation statistics (constant ``input_amax`` or weight-only).
    ``table``: the run's decision table for ``recipe`` (``RunPlan.table``), else the load's plan's
    (``planned_table``): no second decision.
    """
    info = loaded_facts(model)
    if getattr(model, "modelopt_k3_quant", None) is not None:
        raise ValueError("this model is already quantized")
    model.modelopt_k3_quant = quantize_planned(model, info, recipe, forward_loop, table=table, verbose=verbose)
    return model
