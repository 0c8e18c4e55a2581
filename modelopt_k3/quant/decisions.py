"""The decision table: per checkpoint module name, its format, its shared-input group, or why it stays.

Built once from the checkpoint's tensor inventory (names, dtypes, shapes: safetensors headers), the
model spec, the recipe and the shared-input rules (``quant/shared_inputs.py``). ``quantize``/export
and the streaming converter both read it; neither re-derives a recipe decision or a group.

Kinds of modules (decided from the tensors alone, so the converter needs no model):

- ``experts``: routed experts (``spec.experts.key_regex``), one decision per experts module and
  projection (``<module>.*.<proj>``): every expert of a layer gets one format;
- ``linear``: a 2-D float ``weight`` (and optionally ``bias``) whose name is not an embedding's;
- ``embedding``, ``router``, ``conv`` (a 3- to 5-D float ``weight``): never quantized here, but
  ModelOpt gives them quantizers, so it lists them among the unquantized modules (``exclude_modules``). A router is ModelOpt's structural one: ``gate``/``router``/
  ``shared_expert_gate`` with a ``weight`` next to an ``experts`` container (nvidia-modelopt 0.47.0
  ``modelopt/torch/export/quant_utils.py`` ``_get_unquantized_moe_router_names``).

Shared-input groups (ModelOpt 0.47 ``_fuse_shared_input_modules`` -> ``preprocess_linear_fusion``):
only quantized members count; members must have one format (ModelOpt asserts "Modules have
different quantization formats"; it skips the check only when its first-hooked member is FP8, an
order accident we do not reproduce: every mixed group is refused); the group shares the max weight
amax and the max input amax when its weights are NVFP4 or per-tensor FP8 (``shares_group_scales``).
ModelOpt 0.47 skips per-tensor FP8 groups, leaving the engines to requantize them to the max scale (a
second rounding; issue 41, docs/decisions/0006): this project shares them. ModelOpt's fusion is a
no-op for 128x128 block FP8 (one amax per block), so nothing is shared there.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from ..numerics.constants import MXFP4_BLOCK
from ..recipe import QuantFormat, Recipe, RecipeEntry, RecipeError
from ..spec import CarriedModules, ManifestNaming, ModelSpec
from .shared_inputs import SharedInputRule, apply_rules

Kind = Literal["linear", "experts", "embedding", "router", "conv"]
# (dtype, shape) of every checkpoint tensor, by key.
Inventory = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]

PACKED, SCALE = "weight_packed", "weight_scale"
# ``pos_embed``: a vision tower's learned position table (Qwen3.5-MoE's ``model.visual.pos_embed``, an nn.Embedding).
_EMBEDDING_RE = re.compile(r"(^|\.)(embed_tokens|embed_in|tok_embeddings|word_embeddings|wte|wpe|embeddings|pos_embed)$")
_ROUTER_ATTRS = ("gate", "router", "shared_expert_gate")


class InventoryError(ValueError):
    """The checkpoint's tensors contradict the spec (a routed expert stored in an unknown form)."""


def shares_group_scales(fmt: QuantFormat) -> bool:
    """Whether a shared-input group of this format shares weight_scale_2 and input_scale (the registry's rule)."""
    return fmt.weights.shares_group_scales


@dataclass(frozen=True)
class Decision:
    """What happens to one module of the checkpoint."""

    name: str  # checkpoint module name; routed experts: "<experts module>.*.<projection>"
    kind: Kind
    shape: tuple[int, ...]  # (out, in) of the logical weight
    format: QuantFormat | None  # None: stays as the source stores it
    reason: str | None = None  # why it stays (None when quantized)
    group: str | None = None  # the shared-input group whose scales it shares (group id), or None
    packed: bool = False  # stored MXFP4-packed (routed experts)
    experts: tuple[int, ...] = ()  # expert ids present in the checkpoint (kind "experts")

    @property
    def quantized(self) -> bool:
        return self.format is not None

    def module_names(self) -> list[str]:
        """The checkpoint Linears this decision covers (one per expert for routed experts)."""
        if self.kind != "experts":
            return [self.name]
        module, _, proj = self.name.rpartition(".*.")
        return [f"{module}.{e}.{proj}" for e in self.experts]


@dataclass(frozen=True)
class DecisionTable:
    recipe: Recipe
    decisions: dict[str, Decision]
    # group id (its members joined by "+") -> members sharing weight_scale_2 and input_scale
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    rules: tuple[SharedInputRule, ...] | None = None  # the shared-input rules used (None: not needed or not known)
    naming: ManifestNaming | None = None  # how engines spell the model's modules in a manifest (the spec's)

    def of_kind(self, kind: Kind) -> dict[str, Decision]:
        return {n: d for n, d in self.decisions.items() if d.kind == kind}

    def quantized(self) -> dict[str, Decision]:
        return {n: d for n, d in self.decisions.items() if d.quantized}

    def experts(self, module: str) -> dict[str, Decision]:
        """projection -> decision, for one experts module."""
        head = f"{module}.*."
        return {n[len(head) :]: d for n, d in self.decisions.items() if d.kind == "experts" and n.startswith(head)}

    def layer_algos(self) -> dict[str, str]:
        """Every quantized checkpoint Linear (per expert) -> ModelOpt quant_algo."""
        return {m: d.format.algo for d in self.quantized().values() for m in d.module_names()}

    def unquantized_modules(self) -> list[str]:
        """Checkpoint modules ModelOpt gives a quantizer but that stay unquantized (per expert)."""
        return sorted(m for d in self.decisions.values() if not d.quantized for m in d.module_names())

    def check_groups_known(self) -> None:
        """Refuse a table whose dense NVFP4/FP8 Linears may share scales with groups that are unknown."""
        need = [n for n, d in self.of_kind("linear").items() if d.quantized and shares_group_scales(d.format)]
        if need and self.rules is None:
            need_fmt = self.decisions[need[0]].format.weights.name.upper()
            raise RecipeError(
                f"recipe {self.recipe.name} gives {len(need)} dense Linear(s) {need_fmt} (e.g. {need[0]}); Linears that "
                "read the same input must share their global scales, and which ones do is read from the checkpoint's "
                "own modeling code: allow it with trust_remote_code (CLI: --trust_remote_code)"
            )

    def group_input_amax(self, name: str) -> float | None:
        """The constant input amax a module's inputs get: the max over its group (None: calibrated)."""
        d = self.decisions[name]
        members = self.groups.get(d.group, (name,)) if d.group else (name,)
        amaxes = [self.decisions[m].format.input_amax for m in members]
        return None if any(a is None for a in amaxes) else max(amaxes)


def reason_for(entry: RecipeEntry | None) -> str:
    if entry is None:
        return "no recipe entry matches"
    return entry.reason or f"disabled by {entry.source}"


# --------------------------------------------------------------------------- the checkpoint's modules


def _modules(inventory: Inventory, spec: ModelSpec):
    """(dense module -> {part: (dtype, shape)}, (experts module, proj) -> {expert: {part: ...}})."""
    expert_re = re.compile(spec.experts.key_regex)
    dense: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = {}
    experts: dict[tuple[str, str], dict[int, dict[str, tuple[torch.dtype, tuple[int, ...]]]]] = {}
    for key, info in inventory.items():
        m = expert_re.match(key)
        if m is not None:
            experts.setdefault((m["module"], m["proj"]), {}).setdefault(int(m["expert"]), {})[m["tensor"]] = info
        else:
            module, _, part = key.rpartition(".")
            dense.setdefault(module, {})[part] = info
    dense = {name: decoded_parts(parts) for name, parts in dense.items()}
    for (module, proj), by in sorted(experts.items()):
        _same_fields(module, proj, by)
    experts = {k: {e: decoded_parts(parts) for e, parts in by.items()} for k, by in experts.items()}
    return dense, experts


# Source forms a loader decodes to a plain ``weight`` (the spec's converters do it), as their decoded weight:
# block-FP8 (``weight`` float8_e4m3fn + ``weight_scale_inv``) and compressed-tensors INT4 pack-quantized
# (``weight_packed`` int32 ``[out, in/8]`` + ``weight_scale`` + ``weight_shape``). MXFP4 stays as stored
# (its lossless cast reads the codes).
_FP8_SCALE = "weight_scale_inv"
_INT4_PARTS = {PACKED, SCALE, "weight_shape"}


def decoded_parts(parts: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """A module's stored parts with a block-FP8 or INT4 pack-quantized weight shown as the weight it decodes to."""
    weight = parts.get("weight")
    if _FP8_SCALE in parts and weight is not None and weight[0] == torch.float8_e4m3fn:
        rest = {k: v for k, v in parts.items() if k != _FP8_SCALE}
        return {**rest, "weight": (torch.bfloat16, weight[1])}
    packed = parts.get(PACKED)
    if set(parts) >= _INT4_PARTS and packed is not None and packed[0] == torch.int32 and len(packed[1]) == 2:
        rest = {k: v for k, v in parts.items() if k not in _INT4_PARTS}
        return {**rest, "weight": (torch.bfloat16, (packed[1][0], packed[1][1] * 8))}
    return parts


def _is_linear(name: str, parts: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> bool:
    weight = parts.get("weight")
    return (
        weight is not None
        and not _EMBEDDING_RE.search(name)
        and len(weight[1]) == 2
        and weight[0].is_floating_point
        and set(parts) <= {"weight", "bias"}
    )


def _is_conv(parts: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> bool:
    weight = parts.get("weight")
    return weight is not None and 3 <= len(weight[1]) <= 5 and weight[0].is_floating_point and set(parts) <= {"weight", "bias"}


def _expert_shape(name: str, parts: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> tuple[tuple[int, int], bool]:
    if set(parts) == {PACKED, SCALE}:
        (pd, ps), (sd, ss) = parts[PACKED], parts[SCALE]
        shape = (ps[0], ps[1] * 2)
        if pd != torch.uint8 or sd != torch.uint8 or ss != (shape[0], shape[1] // MXFP4_BLOCK):
            raise InventoryError(f"{name} is not MXFP4-packed: {PACKED} {pd} {list(ps)}, {SCALE} {sd} {list(ss)}")
        return shape, True
    if set(parts) == {"weight"}:
        return tuple(parts["weight"][1]), False
    raise InventoryError(f"routed expert {name} has tensors {sorted(parts)}; expected {PACKED}+{SCALE} (MXFP4) or weight")


def _same_fields(module: str, proj: str, by_expert: dict) -> None:
    """Every expert of one projection stores the same tensors: one that lacks a field the others have (an INT4
    ``weight_shape``) is named as missing it, not judged by the format its remaining fields would suggest."""
    fields: dict[frozenset[str], list] = {}
    for e, parts in sorted(by_expert.items()):
        fields.setdefault(frozenset(parts), []).append(e)
    if len(fields) > 1:
        common, *_ = max(fields.items(), key=lambda kv: len(kv[1]))
        odd = next(e for f, es in fields.items() if f != common for e in es)
        missing, extra = sorted(common - set(by_expert[odd])), sorted(set(by_expert[odd]) - common)
        raise InventoryError(f"{module}.{odd}.{proj} stores {sorted(by_expert[odd])}, unlike the other experts "
                             f"({sorted(common)}): " + "; ".join(
                                 [f"missing {', '.join(f'{module}.{odd}.{proj}.{m}' for m in missing)}"] * bool(missing)
                                 + [f"extra {', '.join(extra)}"] * bool(extra)))


def _expert_decisions(recipe: Recipe, spec: ModelSpec, experts: dict) -> dict[str, Decision]:
    out: dict[str, Decision] = {}
    for (module, proj), by_expert in sorted(experts.items()):
        ids = tuple(sorted(by_expert))
        shapes = {_expert_shape(f"{module}.{e}.{proj}", by_expert[e]) for e in ids}
        if len(shapes) > 1:
            raise InventoryError(f"the experts of {module}.*.{proj} are stored in different shapes/forms: {sorted(shapes)}")
        (shape, packed), = shapes
        resolved = {recipe.resolve(f"{module}.{e}.{proj}") for e in ids}
        formats = {fmt for fmt, _ in resolved}
        if len(formats) > 1:
            raise RecipeError(
                f"recipe {recipe.name}: the experts of {module} get different formats for {proj} "
                f"({sorted(str(f) if f else 'bf16' for f in formats)}); all experts of one layer must share one format"
            )
        fmt, entry = recipe.resolve(f"{module}.{ids[0]}.{proj}")
        out[f"{module}.*.{proj}"] = Decision(
            f"{module}.*.{proj}", "experts", shape, fmt, None if fmt else reason_for(entry), packed=packed, experts=ids
        )
    for name in {n.rpartition(".*.")[0] for n in out}:
        for group in spec.quant.shared_scale_groups:
            fmts = {str(out[f"{name}.*.{p}"].format) for p in group if f"{name}.*.{p}" in out}
            if len(fmts) > 1:
                raise RecipeError(
                    f"recipe {recipe.name}: {name} projections {group} share one weight_scale_2/input_scale "
                    f"(one fused kernel) and must get the same format, got {sorted(fmts)}"
                )
    return out


def _routers(dense_names: Iterable[str], experts_modules: set[str]) -> set[str]:
    owners = {m.rpartition(".")[0] for m in experts_modules}
    return {n for n in dense_names if n.rpartition(".")[2] in _ROUTER_ATTRS and n.rpartition(".")[0] in owners}


# --------------------------------------------------------------------------- groups


def _needs_groups(decisions: Mapping[str, Decision]) -> bool:
    return any(d.kind == "linear" and d.quantized and shares_group_scales(d.format) for d in decisions.values())


def _shared_groups(
    recipe: Recipe, decisions: dict[str, Decision], rules: tuple[SharedInputRule, ...] | None
) -> dict[str, tuple[str, ...]]:
    if rules is None:
        return {}
    # A router built as a Linear (Qwen3.5-MoE's shared_expert_gate) reads the input its siblings read: it is a
    # member for the rule to apply, never quantized, so the group is its siblings'.
    linears = [n for n, d in decisions.items() if d.kind in ("linear", "router")]
    groups: dict[str, tuple[str, ...]] = {}
    for readers in apply_rules(rules, linears):  # the structure: every Linear reading the input
        members = tuple(m for m in readers if decisions[m].quantized)  # only quantized members count
        if len(members) < 2:
            continue
        formats = {decisions[m].format.algo for m in members}  # constant input amaxes may differ: max taken
        if len(formats) > 1:
            raise RecipeError(
                f"recipe {recipe.name}: {', '.join(members)} read the same input (a serving engine fuses them) and "
                f"must get one format, got {sorted(formats)}; give them one format or leave some BF16"
            )
        if shares_group_scales(decisions[members[0]].format):
            groups["+".join(members)] = members
    return groups


# --------------------------------------------------------------------------- the table


def decide(
    inventory: Inventory,
    spec: ModelSpec,
    recipe: Recipe,
    rules: tuple[SharedInputRule, ...] | Callable[[], tuple[SharedInputRule, ...] | None] | None,
    carried: CarriedModules | None = None,
) -> DecisionTable:
    """The decision table of a checkpoint for ``recipe``. ``rules``: its shared-input rules, a callable
    giving them (called only when a dense Linear gets a format whose groups share scales, NVFP4 or FP8,
    so recipes without one never run the probe), or None when they are unknown
    (``check_groups_known`` then refuses dense NVFP4 Linears). ``carried``: modules the model does not build
    (``SourceCheckSpec.carried``), kept whatever the recipe says, for the carried reason."""
    dense_parts, expert_parts = _modules(inventory, spec)
    decisions = _expert_decisions(recipe, spec, expert_parts)
    experts_modules = {name.rpartition(".*.")[0] for name in decisions}
    # A router first: one stored like a Linear (Qwen3-MoE's mlp.gate.weight, GPT-OSS's mlp.router) is still a
    # router (ModelOpt's structural rule), never a Linear a recipe pattern could quantize.
    routers = _routers(dense_parts, experts_modules)
    for name in sorted(dense_parts):
        parts = dense_parts[name]
        if name in routers:
            continue
        if _is_linear(name, parts):
            fmt, entry = recipe.resolve(name)
            decisions[name] = Decision(name, "linear", parts["weight"][1], fmt, None if fmt else reason_for(entry))
        elif _EMBEDDING_RE.search(name) and "weight" in parts:
            decisions[name] = Decision(name, "embedding", parts["weight"][1], None, "embedding")
        elif _is_conv(parts):
            decisions[name] = Decision(name, "conv", parts["weight"][1], None, "convolution")
    for name in routers:
        decisions[name] = Decision(name, "router", dense_parts[name]["weight"][1], None, "router")
    if carried is not None:
        for name, d in list(decisions.items()):
            if d.kind in ("linear", "experts") and carried.holds(name):
                decisions[name] = replace(d, format=None, reason=carried.reason, group=None)
    recipe.check_against({m: d.shape for d in decisions.values() if d.kind in ("linear", "experts")
                          for m in d.module_names()}, dense_parts)
    return with_shared_groups(DecisionTable(recipe, dict(sorted(decisions.items())), naming=spec.export.manifest_naming),
                              rules)


def with_shared_groups(
    table: DecisionTable,
    rules: tuple[SharedInputRule, ...] | Callable[[], tuple[SharedInputRule, ...] | None] | None,
) -> DecisionTable:
    """``table`` (decided without groups, as the preflight does from headers alone) with its shared-input
    groups: the one part of the table that needs the model's code (the probe). ``rules`` as for ``decide``.
    Nothing else is re-decided: ``quantize`` takes the run's table this way."""
    if table.groups or table.rules is not None:
        raise ValueError("the decision table already has its shared-input groups")
    decisions = dict(table.decisions)
    if callable(rules):
        rules = rules() if _needs_groups(decisions) else None
    groups = _shared_groups(table.recipe, decisions, rules)
    for gid, members in groups.items():
        for m in members:
            decisions[m] = Decision(m, "linear", decisions[m].shape, decisions[m].format, group=gid)
    return DecisionTable(table.recipe, decisions, groups, rules, table.naming)


def run_table(inventory: Inventory, spec: ModelSpec, recipe: Recipe,
              carried: CarriedModules | None = None) -> DecisionTable:
    """A run's decision table, from headers alone: the one builder every stage that needs a table and was
    given none calls (the preflight, the memory planner, ``quantize(table=None)``, the engine pre-check), so a
    library call decides exactly what hf_ptq's preflight decides. No shared-input groups (they need the
    model's code: ``quantize`` adds them with ``with_shared_groups``)."""
    return decide(inventory, spec, recipe, None, carried)
