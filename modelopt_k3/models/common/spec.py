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
from collections.abc import Callable
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
from .layout import meta_layouts
from .probe import probe_model as default_probe

# Per-expert checkpoint Linears of a gated experts module: ``...mlp.experts.<id>.<proj>.<tensor>``.
EXPERT_KEY_RE = r"^(?P<module>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>(?:gate|up|down)_proj)\.(?P<tensor>\w+)$"
# gate_proj/up_proj are the two halves of ``gate_up_proj`` (transformers' ``Concatenate`` on dim 0 of [E, 2I, H]).
GATED_PROJECTIONS = (
    ExpertProjection("gate_proj", "gate_up_proj", chunk=0, n_chunks=2),
    ExpertProjection("up_proj", "gate_up_proj", chunk=1, n_chunks=2),
    ExpertProjection("down_proj", "down_proj"),
)
# vLLM, SGLang and TensorRT-LLM fuse each expert's gate/up into w13: one weight_scale_2 and one input_scale.
GATE_UP_SHARED = (("gate_proj", "up_proj"),)
# Where the decoder layers sit: ``model.layers.N`` in a causal LM; a VLM's text model has its own prefix
# (Qwen3.5-MoE: ``model.language_model.layers.N``), which the caller passes as ``layers``.
DECODER_LAYERS = "model.layers"


def decoder_unit_key_re(layers: str = DECODER_LAYERS) -> str:
    """``MemorySpec.fsdp_unit_key_regex``: checkpoint keys under one decoder layer, the layer as group ``unit``."""
    return rf"^(?P<unit>{re.escape(layers)}\.\d+)\."


def decoder_layer_re(layers: str = DECODER_LAYERS) -> str:
    """``ReportSpec.decoder_layer_regex``: the in-memory names of the decoder layers."""
    return rf"(?:^|\.){re.escape(layers)}\.\d+$"


DECODER_UNIT_KEY_RE = decoder_unit_key_re()
DECODER_LAYER_RE = decoder_layer_re()


def experts_class(model_class: str) -> type:
    """The experts class of transformers' ``model_class``: the one class of its modeling module decorated by
    transformers' experts interface (SpecError unless exactly one)."""
    module = sys.modules[getattr(transformers, model_class).__module__]  # imported by that getattr
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


def transformers_moe_spec(
    model_type: str,
    model_class: str,
    *,
    num_experts_attr: str | None = None,
    prepare: Callable[[PrepareContext], None] = eager_experts,
    converters: Callable[[PrepareContext], list] | None = None,
    experts: type | None = None,
    experts_spec: ExpertsSpec | None = None,
    model_source: ModelClassSource | None = None,
    loading: dict[str, Any] | None = None,
    quant: dict[str, Any] | None = None,
    activation_memory: Callable[..., Any] | None = None,
    check_config: Callable[[Any], None] | None = None,
    layout_fields: tuple[str, ...] = ("num_hidden_layers",),
    layers: str = DECODER_LAYERS,
    min_transformers: str = "5.0.0",
    **groups: Any,
) -> ModelSpec:
    """The ``ModelSpec`` of transformers' ``model_class`` (see the module docstring).

    ``converters``: the checkpoint conversion (default: transformers' own for ``model_type``). ``experts``:
    transformers' experts class where it cannot be derived. ``experts_spec``/``model_source``: a model whose
    experts are our own module in another layout (GPT-OSS: interleaved gate/up, biases, MXFP4), built by its own
    class. ``loading``/``quant``: further ``LoadingSpec``/``QuantSpec`` fields. ``groups``: the other
    ``ModelSpec`` fields (``recipes``, ``serving``, ``stand_in``, ``source_check``). Without ``source_check`` the
    checkpoint's layout is read off the model built on meta (``layout.py``; its errors quote ``layout_fields``)
    after ``check_config``; without a ``probe_model`` the shared-input probe is ``probe.py``'s. ``layers``: the
    decoder layers' module path (a VLM's text model: ``model.language_model.layers``).
    """
    if experts_spec is None:
        if num_experts_attr is None:
            raise SpecError(f"{model_type}: the config attribute holding the routed-expert count is needed "
                            "(num_experts_attr)")
        experts_spec = ExpertsSpec(
            module_regex=r"\.mlp\.experts$",
            sharded_params={"gate_up_proj": 0, "down_proj": 0},
            projections=GATED_PROJECTIONS,
            num_experts_attr=num_experts_attr,
            key_regex=EXPERT_KEY_RE,
            place_experts=experts_placer(experts or experts_class(model_class)),
        )
    if "source_check" not in groups:
        expert_layout, dense_layout = meta_layouts(model_class, layout_fields, layers=layers)
        groups["source_check"] = SourceCheckSpec(expert_layout=expert_layout, dense_layout=dense_layout,
                                                 check_config=check_config)

    def own_conversion(ctx: PrepareContext) -> list:
        return transformers_conversion(model_type)

    # Separate gate and up projections share their scales; one gate_up projection shares them by itself.
    split = {p.name for p in experts_spec.projections} >= {"gate_proj", "up_proj"}
    quant_fields = {"shared_scale_groups": GATE_UP_SHARED if split else (), "probe_model": default_probe,
                    **(quant or {})}
    return ModelSpec(
        model_type=model_type,
        min_transformers=min_transformers,
        loading=LoadingSpec(model_class=model_source or TransformersClass(model_class), prepare=prepare,
                            converters=converters or own_conversion, **(loading or {})),
        experts=experts_spec,
        quant=QuantSpec(**quant_fields),
        memory=MemorySpec(fsdp_unit_key_regex=decoder_unit_key_re(layers), activation_memory=activation_memory),
        report=ReportSpec(decoder_layer_regex=decoder_layer_re(layers)),
        **groups,
    )


__all__ = ["EXPERT_KEY_RE", "GATED_PROJECTIONS", "experts_class", "transformers_conversion",
           "transformers_moe_spec"]
