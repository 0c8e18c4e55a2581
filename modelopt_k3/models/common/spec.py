"""``transformers_moe_spec``: the spec of a MoE that transformers defines with its own classes, derived from
transformers wherever it can be.

Derived: the experts class (the one class of the model's modeling module that transformers' experts interface
decorates: ``use_experts_implementation`` gives it ``_apply_gate``), its placement and our experts base on its
instances (``experts.experts_placer``), the per-expert checkpoint names and their fusion into
``gate_up_proj``/``down_proj`` (transformers' own conversion mapping, which the loader runs and the exporter
reverses through ``projections``), the decoder-layer regexes (the FSDP2 unit, ``_no_split_modules``, and the
report's hidden states), the gate/up scale sharing every engine's fused ``w13`` needs, and (unless the package
writes its own) the checkpoint layout the source check holds a checkpoint to, from the model built on meta, and
the shared-input probe on a tiny copy of the config. The caller gives what
differs: the config's expert-count attribute, its recipes, serving rules, source formats, memory model, probe.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import transformers
from transformers.conversion_mapping import get_checkpoint_conversion_mapping

from ...spec import (
    ExpertProjection,
    ExpertsSpec,
    LoadingSpec,
    MemorySpec,
    ModelClassSource,
    ModelSpec,
    PrepareContext,
    QuantSpec,
    ReportSpec,
    SourceCheckSpec,
    SpecError,
    TransformersClass,
)
from .experts import experts_placer
from .layout import layer_re as checkpoint_layer_re
from .layout import meta_layouts
from .lazy import ClassRef, resolve_class
from .probe import probe_model as default_probe

# The checkpoint's per-expert gate, up and down Linears of a gated experts module (transformers' own names).
GATED_NAMES = ("gate_proj", "up_proj", "down_proj")
EXPERTS_MODULE = "mlp.experts"


def expert_key_regex(experts_module: str = EXPERTS_MODULE, names: tuple[str, str, str] = GATED_NAMES) -> str:
    """Per-expert checkpoint Linears ``...{experts_module}.<id>.<proj>.<tensor>`` (``ExpertsSpec.key_regex``)."""
    projs = "|".join(re.escape(n) for n in names)
    return rf"^(?P<module>.+\.{re.escape(experts_module)})\.(?P<expert>\d+)\.(?P<proj>(?:{projs}))\.(?P<tensor>\w+)$"


def gated_projections(names: tuple[str, str, str] = GATED_NAMES) -> tuple[ExpertProjection, ...]:
    """gate/up are the two halves of ``gate_up_proj`` (transformers' ``Concatenate`` on dim 0 of [E, 2I, H])."""
    gate, up, down = names
    return (ExpertProjection(gate, "gate_up_proj", chunk=0, n_chunks=2),
            ExpertProjection(up, "gate_up_proj", chunk=1, n_chunks=2),
            ExpertProjection(down, "down_proj"))


EXPERT_KEY_RE = expert_key_regex()
GATED_PROJECTIONS = gated_projections()
DECODER_UNIT_KEY_RE = r"^(?P<unit>model\.layers\.\d+)\."
DECODER_LAYER_RE = r"(?:^|\.)model\.layers\.\d+$"
LAYERS = "model.layers"


def decoder_regexes(layers: str) -> tuple[str, str]:
    """(FSDP2-unit checkpoint key regex, report decoder-layer regex) of the decoder layers under ``layers``."""
    escaped = re.escape(layers)
    return rf"^(?P<unit>{escaped}\.\d+)\.", rf"(?:^|\.){escaped}\.\d+$"


def transformers_base(model_class: str | ClassRef) -> type:
    """transformers' class ``model_class`` names, or the transformers class a package's subclass derives from."""
    if isinstance(model_class, str):
        return getattr(transformers, model_class)
    return next(c for c in resolve_class(model_class).__mro__ if c.__module__.startswith("transformers.models."))


def experts_class(model_class: str | ClassRef) -> type:
    """The experts class of transformers' ``model_class``: the one class of its modeling module decorated by
    transformers' experts interface (SpecError unless exactly one)."""
    module = sys.modules[transformers_base(model_class).__module__]  # imported by that getattr
    found = [obj for name, obj in vars(module).items()
             if isinstance(obj, type) and obj.__module__ == module.__name__ and name.endswith("Experts")
             and hasattr(obj, "_apply_gate")]
    if len(found) != 1:
        raise SpecError(f"{module.__name__} has {len(found)} experts-interface classes, not one: "
                        f"{[c.__name__ for c in found]}; pass experts= to transformers_moe_spec")
    return found[0]


def transformers_conversion(model_type: str) -> list:
    """transformers' own checkpoint conversion for ``model_type`` (a fresh copy: the loader consumes it)."""
    mapping = get_checkpoint_conversion_mapping(model_type)
    if not mapping:
        raise SpecError(f"this transformers has no checkpoint conversion for {model_type!r} (fused experts need >= 5.0)")
    return mapping


def eager_experts(ctx: PrepareContext) -> None:
    """Construct with eager experts; the loader installs the plan's implementation on the built model."""
    ctx.config._experts_implementation = "eager"


@dataclass(frozen=True)
class TransformersSubclass:
    """A package's subclass of transformers' own model class (the checkpoint's names on transformers' modules,
    MiniMax-M2's ``block_sparse_moe``); the config is read with transformers' own config class, no checkpoint
    code runs. ``cls``: the class, or a function giving it when a model is built (``lazy.py``)."""

    cls: ClassRef
    remote_code: bool = field(default=False, init=False)

    def resolve(self, path: Path, raw: Mapping[str, Any], trust_remote_code: bool) -> tuple[type, Any]:
        return resolve_class(self.cls), transformers.AutoConfig.from_pretrained(path, trust_remote_code=False)


def transformers_moe_spec(
    model_type: str,
    model_class: str | ClassRef,
    *,
    num_experts_attr: str | None = None,
    prepare: Callable[[PrepareContext], None] = eager_experts,
    converters: Callable[[PrepareContext], list] | None = None,
    experts: ClassRef | None = None,
    experts_spec: ExpertsSpec | None = None,
    model_source: ModelClassSource | None = None,
    loading: dict[str, Any] | None = None,
    quant: dict[str, Any] | None = None,
    activation_memory: Callable[..., Any] | None = None,
    check_config: Callable[[Any], None] | None = None,
    carried: Callable[[Any], Any] | None = None,
    layout_fields: tuple[str, ...] = ("num_hidden_layers",),
    layers: str = LAYERS,
    experts_module: str = EXPERTS_MODULE,
    expert_names: tuple[str, str, str] = GATED_NAMES,
    min_transformers: str = "5.0.0",
    **groups: Any,
) -> ModelSpec:
    """The ``ModelSpec`` of transformers' ``model_class`` (see the module docstring).

    ``model_class``: transformers' class by name, or a package's subclass of it (``TransformersSubclass``), or a
    function giving that subclass. Classes are resolved when a model is built (the experts class on its first
    placement, ``lazy.py``): building and reading the spec imports no modeling module.
    ``experts_module``/``expert_names``: where the experts live and the checkpoint's per-expert gate, up and
    down Linears, when the model's modules carry the checkpoint's names (MiniMax-M2: ``block_sparse_moe.experts``,
    ``w1``/``w3``/``w2``). ``converters``: the checkpoint conversion (default: transformers' own for ``model_type``). ``experts``:
    transformers' experts class where it cannot be derived. ``experts_spec``/``model_source``: a model whose
    experts are our own module in another layout (GPT-OSS: interleaved gate/up, biases, MXFP4), built by its own
    class. ``loading``/``quant``: further ``LoadingSpec``/``QuantSpec`` fields. ``groups``: the other
    ``ModelSpec`` fields (``recipes``, ``serving``, ``stand_in``, ``source_check``). Without ``source_check`` the
    checkpoint's layout is read off the model built on meta (``layout.py``; its errors quote ``layout_fields``)
    after ``check_config``, ``carried`` the modules it stores that the class does not build (MTP layers:
    ``common/mtp.py``); without a ``probe_model`` the shared-input probe is ``probe.py``'s. ``layers``: the
    decoder layers' module list as the checkpoint names it (Nemotron-H's ``backbone.layers``, a VLM's text model
    under its own prefix: Kimi-K2.5's ``language_model.model.layers``).
    """
    if experts_spec is None:
        if num_experts_attr is None:
            raise SpecError(f"{model_type}: the config attribute holding the routed-expert count is needed "
                            "(num_experts_attr)")
        experts_spec = ExpertsSpec(
            module_regex=rf"\.{re.escape(experts_module)}$",
            sharded_params={"gate_up_proj": 0, "down_proj": 0},
            projections=gated_projections(expert_names),
            num_experts_attr=num_experts_attr,
            key_regex=expert_key_regex(experts_module, expert_names),
            place_experts=experts_placer(experts or (lambda: experts_class(model_class))),
        )
    if "source_check" not in groups:
        gate, up, down = expert_names
        expert_layout, dense_layout = meta_layouts(model_class, layout_fields, rf"\.{re.escape(experts_module)}$",
                                                   fusion={"gate_up_proj": (gate, up), "down_proj": (down,)},
                                                   layer_re=checkpoint_layer_re(layers))
        groups["source_check"] = SourceCheckSpec(expert_layout=expert_layout, dense_layout=dense_layout,
                                                 check_config=check_config, carried=carried)

    unit_re, layer_re = decoder_regexes(layers)

    def own_conversion(ctx: PrepareContext) -> list:
        return transformers_conversion(model_type)

    # Separate gate and up projections share their scales; one gate_up projection shares them by itself.
    halves = tuple(p.name for p in experts_spec.projections if p.fused_param == "gate_up_proj" and p.n_chunks == 2)
    quant_fields = {"shared_scale_groups": (halves,) if halves else (), "probe_model": default_probe,
                    **(quant or {})}
    return ModelSpec(
        model_type=model_type,
        min_transformers=min_transformers,
        loading=LoadingSpec(model_class=model_source or _class_source(model_class), prepare=prepare,
                            converters=converters or own_conversion, **(loading or {})),
        experts=experts_spec,
        quant=QuantSpec(**quant_fields),
        memory=MemorySpec(fsdp_unit_key_regex=unit_re, activation_memory=activation_memory),
        report=ReportSpec(decoder_layer_regex=layer_re),
        **groups,
    )


def _class_source(model_class: str | ClassRef) -> ModelClassSource:
    return TransformersClass(model_class) if isinstance(model_class, str) else TransformersSubclass(model_class)


__all__ = ["EXPERT_KEY_RE", "GATED_PROJECTIONS", "experts_class", "transformers_conversion",
           "transformers_moe_spec"]
