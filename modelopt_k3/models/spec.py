"""Model specs: everything the generic pipeline needs to know about one ``model_type``.

A spec is data plus a few hooks. The generic code (load, quantize, export, distribution) reads it and
never looks at model-specific classes itself; model-specific code lives in ``models/<model>/``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.version import Version

if TYPE_CHECKING:
    from torch import nn

    from .kv_cache import KvCacheSite


class SpecError(ValueError):
    """A model spec refuses a checkpoint, a setting or an environment (user input); the message names the
    cause and the fix."""


@dataclass(frozen=True)
class ExpertProjection:
    """One per-expert Linear of the checkpoint as a slice of a fused parameter.

    ``fused_param[e].chunk(n_chunks, dim=0)[chunk]`` is the ``[out, in]`` weight of
    ``<experts module>.<e>.<name>`` in the checkpoint.
    """

    name: str  # checkpoint name, e.g. "w1"
    fused_param: str  # e.g. "gate_up_proj"
    chunk: int = 0
    n_chunks: int = 1


@dataclass(frozen=True)
class ExpertsLayout:
    """The routed experts one MoE layer must store, as the config says (``ModelSpec.expert_layout``)."""

    module: str  # checkpoint prefix of the layer's experts, e.g. "...layers.3.block_sparse_moe.experts"
    num_experts: int
    projections: Mapping[str, tuple[int, int]]  # checkpoint projection name -> (out, in) of its weight
    source: str = ""  # the config fields these numbers come from (quoted in errors)


@dataclass(frozen=True)
class PrepareContext:
    """What ``ModelSpec.prepare`` gets: the checkpoint's own model class and where it came from."""

    model_cls: type
    config: Any
    checkpoint: Path | None
    experts_implementation: str = "eager"
    # Whether the routed experts are stored MXFP4-packed, as the source check found (None: not checked yet).
    packed_experts: bool | None = None


@dataclass(frozen=True)
class ManifestNaming:
    """How serving engines look one model's modules up in a ModelOpt ``MIXED_PRECISION`` manifest.

    The manifest's keys are checkpoint names, but each engine asks for its own runtime names (another
    prefix, a renamed MoE, fused parameters that hold several checkpoint Linears). ``export/modelopt_format``
    writes every entry under every spelling given here, so one manifest serves every engine.
    """

    # A checkpoint module name (or exclude pattern) -> every spelling an engine may look it up by (itself first).
    aliases: Callable[[str], list[str]]
    # fullmatch on one routed expert's Linear name, group ``bank``: its experts module, which engines key
    # the whole bank's format on (one entry per bank replaces the per-expert ones).
    expert_bank_regex: str
    # (engine fused module, the checkpoint Linears it holds): listed under the parent when every member
    # the checkpoint has there is quantized with one algo.
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Exclude patterns of modules this model keeps BF16 in its usual recipes, written (in every spelling)
    # unless one matches a module the recipe quantizes.
    never_quantized: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    min_transformers: str
    # Import shims, run with the checkpoint directory before its remote code is imported; must not change
    # anything the model computes.
    build: Callable[[Path], object]
    # Patches the checkpoint's own modeling code (fused experts); idempotent.
    prepare: Callable[[PrepareContext], None]
    # Regex (searched) matching the in-memory names of fused experts modules.
    experts_module_regex: str
    # Fused parameter -> the dimension that indexes experts (what expert parallelism shards).
    ep_sharded_params: Mapping[str, int]
    # Per-expert checkpoint Linears as views of the fused parameters, in checkpoint order.
    expert_projections: tuple[ExpertProjection, ...]
    # Groups of projections that must share weight_scale_2 / input_scale (fused gate+up kernels).
    shared_scale_groups: tuple[tuple[str, ...], ...]
    # Config attribute holding the global routed-expert count.
    num_experts_attr: str
    # Checkpoint keys of routed experts, with named groups ``module``, ``expert``, ``proj`` (the
    # ``expert_projections`` name) and ``tensor`` (e.g. ``weight`` or ``weight_packed``).
    expert_key_regex: str
    # (built model, ExpertPlacement) -> None: keep only the placement's experts on every fused experts module
    # and record the placement on the module instance (``module.placement``), never on a shared class.
    place_experts: Callable[[nn.Module, Any], None]
    # Source weight formats prepare's converters decompress (compressed-tensors format names).
    source_formats: frozenset[str] = frozenset()
    # Parameters (regex on in-memory names) kept in their checkpoint dtype instead of the load dtype,
    # where rounding would change behaviour (e.g. a routing bias that decides expert selection).
    keep_source_dtype: str | None = None
    # Conversions of dense checkpoint tensors into the parameters the model declares (transformers
    # ``WeightConverter``s, run by the loader on the whole source tensor), e.g. a zero-padded vector.
    dense_converters: tuple[Any, ...] = ()
    # model -> where its KV cache is (``models/kv_cache.py``; the quantization layer attaches the
    # ``k_scale``/``v_scale`` quantizers there); None = no KV-cache quantization for this model.
    kv_cache_sites: Callable[[nn.Module], list[KvCacheSite]] | None = None
    # Memory planner (memory/planner.py): checkpoint keys of the FSDP2 units (the model's
    # ``_no_split_modules`` instances), with the unit's prefix as named group ``unit``; and the
    # activation model of one calibration forward (``ActivationModel`` from text config, batch, seq, dtype bytes).
    fsdp_unit_key_regex: str | None = None
    activation_memory: Callable[..., Any] | None = None
    # config.json (parsed JSON, no remote code) -> every MoE layer's routed experts (``source_check``).
    expert_layout: Callable[[Mapping[str, Any]], tuple[ExpertsLayout, ...]] | None = None
    # (model class, config, device) -> (a tiny model of the checkpoint's own classes on that device, prefix
    # of its names in the checkpoint): the shared-input probe (quant/shared_inputs.py) runs one forward of it.
    probe_model: Callable[[type, Any, Any], tuple[nn.Module, str]] | None = None
    # How engines spell this model's modules in a MIXED_PRECISION manifest (None: checkpoint names only).
    manifest_naming: ManifestNaming | None = None
    # Module names (regex, searched) that a text calibration forward never runs (a vision tower): a recipe
    # that needs their activations is refused in the preflight, not after calibration.
    uncalibrated_module_regex: str | None = None
    # config.json -> (key regex (fullmatch), shape or None, the config fields behind it) for dense tensors whose
    # shape the config fixes, and (shape None) the keys whose ``layer`` group must be < num_hidden_layers:
    # what the converter checks when it does not build the model (``source_check.check_dense_against_config``).
    dense_layout: Callable[[Mapping[str, Any]], tuple[tuple[str, tuple[int, ...] | None, str], ...]] | None = None
    # config.json -> None, or SpecError naming the first field the tools read that is missing or invalid
    # (run before anything reads the config: ``source_check.check_config``).
    check_config: Callable[[Mapping[str, Any]], None] | None = None
    # Regex (searched) matching the in-memory names of the language model's decoder layers, whose outputs
    # are the hidden states the quantization report compares (report/, quant/evaluate.py); None: none.
    decoder_layer_regex: str | None = None
    # Where the model class comes from when not the checkpoint's remote code: an object with ``remote_code``
    # and ``resolve(path, raw config, trust_remote_code) -> (class, config)`` (None: config.json's auto_map).
    model_class: Any = None
    # Routers (regex, searched) stored like a Linear (weight + bias) that the model does not hold as an
    # ``nn.Linear`` (GPT-OSS's ``GptOssTopKRouter``): decided as routers, never as quantizable Linears.
    router_regex: str | None = None

    def check_transformers(self) -> None:
        import transformers

        have = Version(transformers.__version__)
        if have < Version(self.min_transformers):
            raise SpecError(
                f"model_type {self.model_type!r} needs transformers>={self.min_transformers}, "
                f"but transformers {transformers.__version__} is installed"
            )

    def experts_modules(self, model: nn.Module) -> dict[str, nn.Module]:
        """The model's fused experts modules by name."""
        return {name: m for name, m in model.named_modules() if self.is_experts_module(name, m)}

    def decoder_layers(self, model: nn.Module) -> dict[str, nn.Module]:
        """The language model's decoder layers by name, in forward order (empty without a regex)."""
        import re

        if self.decoder_layer_regex is None:
            return {}
        return {name: m for name, m in model.named_modules() if re.search(self.decoder_layer_regex, name)}

    def is_experts_module(self, name: str, module: nn.Module) -> bool:
        import re

        return re.search(self.experts_module_regex, name) is not None and all(
            hasattr(module, p) for p in self.ep_sharded_params
        )


_REGISTRY: dict[str, ModelSpec] = {}
# model_type -> module that registers its spec on import (lazy, so importing the package stays cheap).
_BUILTIN: dict[str, str] = {
    "kimi_k3": "modelopt_k3.models.kimi_k3",
    "gpt_oss": "modelopt_k3.models.gpt_oss",
}


def register_spec(spec: ModelSpec, *, overwrite: bool = False) -> ModelSpec:
    if spec.model_type in _REGISTRY and not overwrite:
        raise SpecError(f"a spec for model_type {spec.model_type!r} is already registered")
    _REGISTRY[spec.model_type] = spec
    return spec


def get_spec(model_type: str) -> ModelSpec:
    if model_type not in _REGISTRY and model_type in _BUILTIN:
        importlib.import_module(_BUILTIN[model_type])
    try:
        return _REGISTRY[model_type]
    except KeyError:
        known = sorted(set(_REGISTRY) | set(_BUILTIN))
        raise SpecError(f"no model spec for model_type {model_type!r}; known: {known}") from None

