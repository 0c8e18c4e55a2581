"""The model-spec contract: what the generic pipeline needs to know about one ``model_type``.

A spec is data plus a few hooks, grouped by who reads them, so each stage sees only its part:

* ``LoadingSpec``     - the loader (``load/``) and the converter's model build: where the model class comes
  from (the checkpoint's remote code or transformers' own class), import shims, ``prepare``, dtype and
  dense-conversion rules.
* ``ExpertsSpec``     - everything that touches routed experts: the loader's expert reads, the distribution
  plan and placement, FSDP2, packed residency, quantize, export, the report, the memory layout.
* ``QuantSpec``       - decisions, calibration and the preflight: shared-scale groups, the KV cache, the
  shared-input probe, modules text calibration never runs.
* ``ExportSpec``      - ``export/``: how engines spell the model's modules in a MIXED_PRECISION manifest.
* ``MemorySpec``      - the memory planner (``memory/``): FSDP2 units and the activation model.
* ``SourceCheckSpec`` - ``source_check`` (load and converter): config.json against the checkpoint's headers.
* ``ReportSpec``      - the quantization report and ``quant/evaluate``: the decoder layers it compares.
* ``RecipesSpec``     - the command lines (``cli/``): which recipe ``--qformat`` names for this model and what
  the calibration-free converter writes when no ``--recipe`` is given.
* ``ServingSpec``     - the engine checks (``check/engines``): what each serving engine's class for this model
  does when it loads an export, and the KV-cache scale tensors an export holds.
* ``stand_in``        - the tiny stand-in checkpoint generator tests and examples use (``testing.make_tiny``).

A model registers one spec and nothing else: no registry outside this one, no module found by its file name.

The generic code reads a spec and never looks at model-specific classes itself; model-specific code
lives in ``models/<model>/``. This module imports nothing from ``modelopt_k3`` (it is the bottom layer
every other package may import).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from packaging.version import Version

if TYPE_CHECKING:
    from torch import nn

    from .kv_cache import KvCacheSite


class SpecError(ValueError):
    """A model spec refuses a checkpoint, a setting or an environment (user input); the message names the
    cause and the fix."""


# --- declarations the groups are made of -----------------------------------------------------------------


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
    """The routed experts one MoE layer must store, as the config says (``SourceCheckSpec.expert_layout``)."""

    module: str  # checkpoint prefix of the layer's experts, e.g. "...layers.3.block_sparse_moe.experts"
    num_experts: int
    projections: Mapping[str, tuple[int, int]]  # checkpoint projection name -> (out, in) of its weight
    source: str = ""  # the config fields these numbers come from (quoted in errors)


@dataclass(frozen=True)
class PrepareContext:
    """What ``LoadingSpec.prepare`` gets: the model class (as ``LoadingSpec.model_class`` resolved it) and
    where it came from."""

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


# --- how the model class is obtained -------------------------------------------------------------------


class ModelClassSource(Protocol):
    """Where a spec's model class comes from; the loader calls ``resolve`` and nothing else decides it."""

    remote_code: bool  # True: resolving runs code shipped with the checkpoint (needs trust_remote_code)

    def resolve(self, path: Path, raw: Mapping[str, Any], trust_remote_code: bool) -> tuple[type, Any]:
        """(model class, transformers config) for the checkpoint at ``path`` (``raw``: its config.json)."""
        ...


@dataclass(frozen=True)
class RemoteCodeClass:
    """The checkpoint ships its own modeling code (config.json ``auto_map``); loading it runs that code, so
    it is refused unless ``trust_remote_code``."""

    auto_classes: tuple[str, ...] = ("AutoModelForCausalLM", "AutoModel")  # auto_map entries, first present wins
    remote_code: bool = field(default=True, init=False)

    def resolve(self, path: Path, raw: Mapping[str, Any], trust_remote_code: bool) -> tuple[type, Any]:
        from transformers import AutoConfig
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        auto_map = raw.get("auto_map") or {}
        ref = next((auto_map[name] for name in self.auto_classes if auto_map.get(name)), None)
        if ref is None:
            raise SpecError(f"{path}/config.json has no auto_map entry for {'/'.join(self.auto_classes)}")
        if not trust_remote_code:
            raise SpecError(
                f"{path} ships its own modeling code ({ref}); loading it runs that code. "
                "Pass trust_remote_code=True (CLI: --trust_remote_code) if you trust this checkpoint."
            )
        config = AutoConfig.from_pretrained(path, trust_remote_code=True)
        return get_class_from_dynamic_module(ref, str(path)), config


@dataclass(frozen=True)
class TransformersClass:
    """transformers' own model class, by its name in the ``transformers`` namespace (e.g.
    ``"Qwen3MoeForCausalLM"``); the config is read with transformers' own config class. No checkpoint code
    runs, so ``trust_remote_code`` is neither needed nor passed on."""

    name: str
    remote_code: bool = field(default=False, init=False)

    def resolve(self, path: Path, raw: Mapping[str, Any], trust_remote_code: bool) -> tuple[type, Any]:
        import transformers

        model_cls = getattr(transformers, self.name, None)
        if model_cls is None:
            raise SpecError(f"transformers {transformers.__version__} has no class {self.name!r} (needed by {path})")
        return model_cls, transformers.AutoConfig.from_pretrained(path, trust_remote_code=False)


def _no_import_shims(checkpoint: Path) -> None:
    """The default ``LoadingSpec.build``: nothing to shim."""


def _no_converters(ctx: PrepareContext) -> list:
    """The default ``LoadingSpec.converters``: checkpoint names are the model's parameter names."""
    return []


# --- the groups ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadingSpec:
    """Read by the loader (``load/``) and the converter when it builds the model (``convert/plan.py``)."""

    # Where the model class comes from: the checkpoint's remote code or a transformers class.
    model_class: ModelClassSource
    # Patches the model's classes (fused experts on transformers' experts interface); idempotent.
    prepare: Callable[[PrepareContext], None]
    # Import shims, run with the checkpoint directory before its model class is resolved; must not change
    # anything the model computes.
    build: Callable[[Path], object] = _no_import_shims
    # Source weight formats prepare's converters decompress (compressed-tensors format names).
    source_formats: frozenset[str] = frozenset()
    # Parameters (regex on in-memory names) kept in their checkpoint dtype instead of the load dtype,
    # where rounding would change behaviour (e.g. a routing bias that decides expert selection).
    keep_source_dtype: str | None = None
    # Conversions of dense checkpoint tensors into the parameters the model declares (transformers
    # ``WeightConverter``s, run by the loader on the whole source tensor), e.g. a zero-padded vector.
    dense_converters: tuple[Any, ...] = ()
    # The checkpoint conversion mapping: (the context ``prepare`` got) -> transformers ``WeightConverter``s /
    # ``WeightRenaming``s from checkpoint names to the prepared model's parameters, which the loader runs on
    # this rank's tensors (e.g. per-expert w1/w3 -> gate_up_proj, with the MXFP4 decode when packed).
    converters: Callable[[PrepareContext], list] = _no_converters
    # The checkpoint view: the checked safetensors headers (key -> ``checkpoint.TensorInfo``) -> the tensors
    # the pipeline should see, for a checkpoint that stores what the pipeline reads per expert in another
    # layout (GPT-OSS's fused ``[E, ...]`` MXFP4 blocks as per-expert ``weight_packed``/``weight_scale``).
    # Every entry it returns is a contiguous byte range of a stored tensor (``CheckpointReader`` reads it so).
    checkpoint_view: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None


@dataclass(frozen=True)
class ExpertsSpec:
    """Read by everything that touches routed experts: the loader's expert reads, the distribution plan,
    FSDP2, packed residency, quantize, export, the report and the memory layout."""

    # Regex (searched) matching the in-memory names of fused experts modules.
    module_regex: str
    # Fused parameter -> the dimension that indexes experts (what expert parallelism shards).
    sharded_params: Mapping[str, int]
    # Per-expert checkpoint Linears as views of the fused parameters, in checkpoint order.
    projections: tuple[ExpertProjection, ...]
    # Config attribute (of the text config) holding the global routed-expert count.
    num_experts_attr: str
    # Checkpoint keys of routed experts, with named groups ``module``, ``expert``, ``proj`` (the
    # ``projections`` name) and ``tensor`` (e.g. ``weight`` or ``weight_packed``).
    key_regex: str
    # (built model, ExpertPlacement) -> None: keep only the placement's experts on every fused experts module
    # and record the placement on the module instance (``module.placement``), never on a shared class.
    place_experts: Callable[[nn.Module, Any], None]

    def is_module(self, name: str, module: nn.Module) -> bool:
        return re.search(self.module_regex, name) is not None and all(hasattr(module, p) for p in self.sharded_params)

    def modules(self, model: nn.Module) -> dict[str, nn.Module]:
        """The model's fused experts modules by name."""
        return {name: m for name, m in model.named_modules() if self.is_module(name, m)}


@dataclass(frozen=True)
class QuantSpec:
    """Read by quantization: decisions (``quant/decisions.py``), calibration (``quant/api.py``), the
    shared-input probe (``quant/shared_inputs.py``), the converter's plan and the preflight."""

    # Groups of expert projections that must share weight_scale_2 / input_scale (fused gate+up kernels).
    shared_scale_groups: tuple[tuple[str, ...], ...] = ()
    # model -> where its KV cache is (``spec/kv_cache.py``; the quantization layer attaches the
    # ``k_scale``/``v_scale`` quantizers there); None = no KV-cache quantization for this model.
    kv_cache_sites: Callable[[nn.Module], list[KvCacheSite]] | None = None
    # (model class, config, device) -> (a tiny model of the model's own classes on that device, prefix of
    # its names in the checkpoint): the shared-input probe runs one forward of it.
    probe_model: Callable[[type, Any, Any], tuple[nn.Module, str]] | None = None
    # Module names (regex, searched) that a text calibration forward never runs (a vision tower): a recipe
    # that needs their activations is refused in the preflight, not after calibration.
    uncalibrated_module_regex: str | None = None


@dataclass(frozen=True)
class ExportSpec:
    """Read by ``export/`` (and the decisions that name manifest entries)."""

    # How engines spell this model's modules in a MIXED_PRECISION manifest (None: checkpoint names only).
    manifest_naming: ManifestNaming | None = None


@dataclass(frozen=True)
class MemorySpec:
    """Read by the memory planner (``memory/inventory.py``, ``memory/planner.py``)."""

    # Checkpoint keys of the FSDP2 units (the model's ``_no_split_modules`` instances), with the unit's
    # prefix as named group ``unit``.
    fsdp_unit_key_regex: str | None = None
    # The activation model of one calibration forward (``ActivationModel`` from text config, batch, seq,
    # dtype bytes).
    activation_memory: Callable[..., Any] | None = None


@dataclass(frozen=True)
class SourceCheckSpec:
    """Read by ``source_check`` (the loader and the converter, before anything builds or reads weights)."""

    # config.json (parsed JSON, no remote code) -> every MoE layer's routed experts.
    expert_layout: Callable[[Mapping[str, Any]], tuple[ExpertsLayout, ...]] | None = None
    # config.json -> (key regex (fullmatch), shape or None, the config fields behind it) for dense tensors whose
    # shape the config fixes, and (shape None) the keys whose ``layer`` group must be < num_hidden_layers:
    # what the converter checks when it does not build the model (``source_check.check_dense_against_config``).
    dense_layout: Callable[[Mapping[str, Any]], tuple[tuple[str, tuple[int, ...] | None, str], ...]] | None = None
    # config.json -> dense keys every checkpoint of that config stores (routers, norms, dense MLPs, ...): a missing
    # one is refused by the converter when it does not build the model, as ``load_pretrained`` refuses it.
    dense_required: Callable[[Mapping[str, Any]], tuple[str, ...]] | None = None
    # True: ``dense_required`` is every dense key such a checkpoint stores, so any other key that is not a routed
    # expert's (``ExpertsSpec.key_regex``) is refused as a tensor the model has no place for, as the model path
    # refuses it (Kimi-K3: tested equal to the stand-in's and the full-size layout's dense keys).
    dense_exact: bool = False
    # config.json -> None, or SpecError naming the first field the tools read that is missing or invalid
    # (run before anything reads the config: ``source_check.check_config``).
    check_config: Callable[[Mapping[str, Any]], None] | None = None
    # config.json -> the modules the checkpoint stores but the model class does not build (DeepSeek-V3's MTP
    # layers), or None: carried into an export unquantized (``CarriedModules``).
    carried: Callable[[Mapping[str, Any]], CarriedModules | None] | None = None


@dataclass(frozen=True)
class CarriedModules:
    """Checkpoint modules no model class builds, carried into every export unquantized (DeepSeek-V3's MTP layers,
    ``model.layers.{num_hidden_layers + j}``): never loaded, calibrated or quantized (the decision table keeps
    them, so an export lists them in its exclusions); both paths write their tensors as stored, a weight stored
    in a source format the spec decodes (block-FP8, INT4) written decoded as a kept Linear is. The source check
    (``source_check.check_carried``) refuses a missing, stray or mis-shaped tensor under them."""

    prefixes: tuple[str, ...]  # module names; every key under one (``prefix.``) is carried
    # every logical tensor they hold -> shape; a Linear's ``weight`` (routed experts per expert, as stored) may be
    # stored in a source format that decodes to that shape
    tensors: Mapping[str, tuple[int, ...]]
    reason: str  # why they are kept, as the decision table and the report give it

    def holds(self, key: str) -> bool:
        return any(key.startswith(f"{p}.") for p in self.prefixes)


@dataclass(frozen=True)
class ReportSpec:
    """Read by the quantization report (``report/``) and ``quant/evaluate.py``."""

    # Regex (searched) matching the in-memory names of the language model's decoder layers, whose outputs
    # are the hidden states the report compares; None: none.
    decoder_layer_regex: str | None = None


@dataclass(frozen=True)
class RecipesSpec:
    """Read by the command lines (``cli/hf_ptq``, ``cli/convert``): the model's own recipe for each ``--qformat``
    name and the converter's default, so a preset tuned for one model is never applied to another."""

    # --qformat name -> recipe name, for the names where this model needs its own recipe (the others fall
    # back to the generic ``presets/<name>``; an algorithm's ``nvfp4_<preset>`` follows ``nvfp4``: run/plan.recipe_name).
    qformat: Mapping[str, str] = field(default_factory=dict)
    # The recipe modelopt-k3-convert writes without --recipe; None: the model has no calibration-free NVFP4
    # recipe (e.g. BF16 experts, whose input scales need calibration) and --recipe is required.
    converter: str | None = None
    # Why ``converter`` is None, quoted in the refusal.
    no_converter_reason: str = ""


@dataclass(frozen=True)
class ServingSpec:
    """Read by the engine checks (``check/engines``: ``modelopt-k3-check`` and the export's engine check)."""

    # () -> engine name ("vllm", "sglang", "trtllm") -> what that engine's class for this model does when it
    # loads an export (a ``check.engines.base.ModelServing``, or a replay function for an engine whose model
    # class is replayed whole). A function: the rules are built from ``check/``'s classes, a layer above the
    # loader, so they are imported when a check first asks, not with the spec.
    rules: Callable[[], Mapping[str, Any]] | None = None
    # config.json -> the KV-cache scale tensors an export with a KV-cache format holds (None: none).
    kv_scale_names: Callable[[Mapping[str, Any]], list[str]] | None = None
    # What the decoder layers' RMSNorms add to their stored weight before scaling (1.0: ``x * (1 + weight)``, as
    # Qwen3.5/Qwen3-Next store zero-centered gains): the activation-scale plausibility bound reads the gain so.
    norm_weight_offset: float = 0.0


@dataclass(frozen=True)
class ModelSpec:
    """One model type's spec: its identity and one group per consumer (see the module docstring)."""

    model_type: str
    min_transformers: str
    loading: LoadingSpec
    experts: ExpertsSpec
    quant: QuantSpec = QuantSpec()
    export: ExportSpec = ExportSpec()
    memory: MemorySpec = MemorySpec()
    source_check: SourceCheckSpec = SourceCheckSpec()
    report: ReportSpec = ReportSpec()
    recipes: RecipesSpec = RecipesSpec()
    serving: ServingSpec = ServingSpec()
    # (path, **sizes) -> Path: writes the model's tiny stand-in checkpoint at ``path`` (``testing.make_tiny``);
    # None: the model has none.
    stand_in: Callable[..., Path] | None = None

    def converter_recipe(self) -> str:
        """The recipe the converter writes without ``--recipe``; SpecError when the model has none."""
        if self.recipes.converter is None:
            reason = f" ({self.recipes.no_converter_reason})" if self.recipes.no_converter_reason else ""
            raise SpecError(
                f"model_type {self.model_type!r} has no calibration-free default recipe{reason}: pass --recipe "
                "(a weight-only recipe such as presets/w4a16_nvfp4), or quantize with modelopt-k3-ptq"
            )
        return self.recipes.converter

    def check_transformers(self) -> None:
        import transformers

        have = Version(transformers.__version__)
        if have < Version(self.min_transformers):
            raise SpecError(
                f"model_type {self.model_type!r} needs transformers>={self.min_transformers}, "
                f"but transformers {transformers.__version__} is installed"
            )

    def experts_modules(self, model: nn.Module) -> dict[str, nn.Module]:
        """The model's fused experts modules by name (``ExpertsSpec.modules``)."""
        return self.experts.modules(model)

    def is_experts_module(self, name: str, module: nn.Module) -> bool:
        return self.experts.is_module(name, module)

    def decoder_layers(self, model: nn.Module) -> dict[str, nn.Module]:
        """The language model's decoder layers by name, in forward order (empty without a regex)."""
        regex = self.report.decoder_layer_regex
        if regex is None:
            return {}
        return {name: m for name, m in model.named_modules() if re.search(regex, name)}
