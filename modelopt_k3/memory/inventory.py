"""A checkpoint's tensor layout from ``config.json`` and the safetensors headers alone.

No tensor byte is read and no model is built: a full-size Kimi-K3 (about half a million tensors) is
parsed in seconds, and a header-only or sparse checkpoint (``testing.header_only``) plans like the real one.
The model spec says which keys are routed experts (``ExpertsSpec.key_regex``), how they fuse
(``ExpertsSpec.projections``) and which key prefixes are FSDP2 units (``MemorySpec.fsdp_unit_key_regex``).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..checkpoint import CheckpointReader, read_config
from ..checkpoint.source_check import SourceLayout, check_experts
from ..quant.decisions import DecisionTable, run_table
from ..spec import ModelSpec, get_spec
from ..spec.config import load_dtype

if TYPE_CHECKING:
    from ..quant.decisions import Inventory
    from ..recipe import QuantFormat, Recipe
    from ..spec.contract import CarriedModules

# compressed-tensors' names for an MXFP4 ("pack-quantized") weight's codes and block scales.
PACKED_CODES, PACKED_SCALES = "weight_packed", "weight_scale"
# Per-Linear source tensors that are not the weight (a block-FP8 scale, an INT4 weight's stored shape).
SOURCE_SIDE_TENSORS = ("weight_scale_inv", "weight_shape")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def module(self) -> str:
        return self.name.rpartition(".")[0]


@dataclass
class ExpertGroup:
    """One fused experts module as stored: ``num_experts`` experts, each with these projections."""

    module: str
    num_experts: int = 0
    packed: bool = False  # the source check's decision for the checkpoint (``SourceLayout.packed_experts``)
    stored_bytes: int = 0  # all experts, as stored (packed: codes + scales)
    stored_tensors: int = 0  # all experts' tensors, as stored (the loader's per-tensor work)
    # projection name -> decoded (out, in) per expert
    projections: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def stored_bytes_per_expert(self) -> int:
        return self.stored_bytes // max(self.num_experts, 1)

    @property
    def stored_tensors_per_expert(self) -> float:
        return self.stored_tensors / max(self.num_experts, 1)

    @property
    def decoded_numel_per_expert(self) -> int:
        return sum(o * i for o, i in self.projections.values())

    def fused_shapes(self, spec: ModelSpec) -> dict[str, tuple[int, int]]:
        """fused param -> decoded (out, in) per expert (projections concatenated on rows)."""
        out: dict[str, tuple[int, int]] = {}
        for proj in spec.experts.projections:
            o, i = self.projections[proj.name]
            rows, cols = out.get(proj.fused_param, (0, i))
            out[proj.fused_param] = (rows + o, cols)
        return out


@dataclass
class CheckpointLayout:
    path: Path
    config: dict
    spec: ModelSpec
    dense: list[TensorMeta]
    experts: list[ExpertGroup]
    cache: dict = field(default_factory=dict, repr=False)  # the planner's per-recipe precomputation
    # What ``decide`` reads, for a caller with no run's decision table: the headers' inventory (through the
    # checkpoint view) and the modules carried unquantized (``SourceLayout.carried``).
    inventory: Inventory = field(default_factory=dict, repr=False)
    carried: CarriedModules | None = None
    # The stored tensors under the carried modules (MTP layers, Kimi-K2.5's vision tower): no model builds them,
    # so they are never resident; the export reads and writes them (``dense``/``experts`` leave them out).
    carried_tensors: list[TensorMeta] = field(default_factory=list)

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config", self.config)

    @property
    def num_experts(self) -> int:
        return int(self.text_config[self.spec.experts.num_experts_attr])

    @property
    def config_dtype(self) -> torch.dtype:
        return load_dtype(self.config)

    @property
    def packed_source(self) -> bool:
        return bool(self.experts) and all(g.packed for g in self.experts)

    @cached_property
    def _kept_source_dtype(self) -> frozenset[str]:
        keep = self.spec.loading.keep_source_dtype
        return frozenset(t.name for t in self.dense if keep and re.search(keep, t.name))

    def load_dtype(self, tensor: TensorMeta, dtype: torch.dtype) -> torch.dtype:
        """The dtype a dense tensor has once loaded (the spec keeps some in their source dtype)."""
        return tensor.dtype if tensor.name in self._kept_source_dtype else dtype

    def fsdp_units(self) -> dict[str, list[TensorMeta]]:
        """Dense tensors by FSDP2 unit prefix ("" = the root, which holds what no unit does)."""
        units: dict[str, list[TensorMeta]] = defaultdict(list)
        unit_re = re.compile(self.spec.memory.fsdp_unit_key_regex) if self.spec.memory.fsdp_unit_key_regex else None
        for t in self.dense:
            m = unit_re.match(t.name) if unit_re else None
            units[m["unit"] if m else ""].append(t)
        return units

    def decision_table(self, recipe: Recipe) -> DecisionTable:
        """The recipe against this checkpoint's modules: ``run_table`` (the builder hf_ptq's preflight decides the
        run's table with) on the same headers; no shared-input groups (sizes do not depend on them). Once per
        recipe; a run passes its own table instead (``fit_plan(table=)``)."""
        key = ("table", id(recipe))
        if key not in self.cache:
            self.cache[key] = (recipe, run_table(self.inventory, self.spec, recipe, self.carried))
        return self.cache[key][1]

    def linear_weights(self) -> dict[str, tuple[int, int]]:
        """Dense 2-D ``.weight`` tensors by module name, with their [out, in] (recipe matching)."""
        return {t.module: (t.shape[0], t.shape[1]) for t in self.dense if t.name.endswith(".weight") and len(t.shape) == 2}


def read_layout(path: str | Path) -> CheckpointLayout:
    """Parse ``config.json`` and every shard's header (nothing else) into a ``CheckpointLayout``."""
    path = Path(path)
    config = read_config(path)  # the one reader's checks: a regular file, strict JSON
    spec = get_spec(config.get("model_type", ""))
    with CheckpointReader(path, view=spec.loading.checkpoint_view) as reader:
        source = check_experts(reader.headers(), config, spec, reader.stored_name)  # the loader's own check
        return layout_of(reader, config, spec, source)


def layout_of(reader: CheckpointReader, config: dict, spec: ModelSpec, source: SourceLayout) -> CheckpointLayout:
    """``read_layout`` of the checkpoint an open ``reader`` has already read the headers of (hf_ptq's
    preflight: the headers are read once per run), whose experts ``source`` (``check_experts``) checked: its
    decision whether they are packed is taken, not made again. Through the reader's checks and the model's
    checkpoint view: GPT-OSS's fused MXFP4 experts count as the per-expert tensors the pipeline reads (a raw
    header walk saw "0 MoE layers", "stored decoded"). The carried modules' tensors (``source.carried_keys``: the
    load never reads them, the export copies them) are set apart from what the load builds, as the load does."""
    stored = [(name, info.dtype, tuple(info.shape)) for name, info in reader.headers().items()]
    carried = [TensorMeta(name, dtype, shape) for name, dtype, shape in stored if name in source.carried_keys]
    built = [(name, dtype, shape) for name, dtype, shape in stored if name not in source.carried_keys]
    layout = _layout(reader.path, config, spec, built, source.packed_experts)
    layout.inventory, layout.carried, layout.carried_tensors = reader.inventory(), source.carried, carried
    return layout


def dense_format(table: DecisionTable, module: str) -> QuantFormat | None:
    """The format the decision table gives a dense Linear's weight (None: kept as stored: unquantized by the
    recipe, a router, an embedding, a carried module)."""
    d = table.decisions.get(module)
    return d.format if d is not None and d.kind == "linear" else None


def experts_formats(table: DecisionTable, group: ExpertGroup, spec: ModelSpec) -> dict[str, QuantFormat | None]:
    """fused parameter -> the format the decision table gives its projections (projections fused into one
    parameter share a format: ``decide`` refuses a recipe that splits a shared-scale group)."""
    decided = table.experts(group.module)
    out: dict[str, QuantFormat | None] = {}
    for proj in spec.experts.projections:
        if proj.name in decided and proj.fused_param not in out:
            out[proj.fused_param] = decided[proj.name].format
    return out


def _layout(path: Path, config: dict, spec: ModelSpec, stored: list[tuple[str, torch.dtype, tuple[int, ...]]],
            packed: bool) -> CheckpointLayout:
    key_re = re.compile(spec.experts.key_regex)
    dense: list[TensorMeta] = []
    groups: dict[str, ExpertGroup] = {}
    experts_seen: dict[str, set[str]] = defaultdict(set)
    for name, dtype, shape in stored:
        m = key_re.match(name)
        if m is None:
            dense.append(TensorMeta(name, dtype, shape))
            continue
        module, expert, proj, kind = m.group("module", "expert", "proj", "tensor")
        group = groups.get(module) or groups.setdefault(module, ExpertGroup(module, packed=packed))
        experts_seen[module].add(expert)
        group.stored_bytes += math.prod(shape) * dtype.itemsize
        group.stored_tensors += 1
        if kind == PACKED_CODES and dtype == torch.int32:  # INT4 pack-quantized: 8 values a word, decoded
            group.projections[proj] = (shape[0], shape[1] * 8)
        elif kind == PACKED_CODES:  # MXFP4: two E2M1 codes a byte
            group.projections[proj] = (shape[0], shape[1] * 2)
        elif kind not in (PACKED_SCALES, *SOURCE_SIDE_TENSORS):
            group.projections[proj] = (shape[0], shape[1])
    for name, group in groups.items():
        group.num_experts = len(experts_seen[name])
    return CheckpointLayout(path, config, spec, dense, sorted(groups.values(), key=lambda g: g.module))
