"""A PTQ run's settings and its plan: ``PtqConfig`` (what was asked, typed and frozen: parsed from the CLI or
made in Python) and ``RunPlan`` (what the preflight decided from it, once, before any weight is read).

The preflight (``preflight.py``) reads the checkpoint's config and headers once, and decides the model spec,
the experts' source layout (is the source packed), the decision table, the distribution plan with its
experts residency, and the memory estimate; ``RunPlan`` carries them. Load (``load_planned``), quantize
(``table=``), export (``format=``), the report and the planner take what they need from it instead of
deciding it again. torchtitan's habit: a typed config parsed once, one validated plan handed down.

Torch-free at import (the CLI builds a ``PtqConfig`` before importing torch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..dist.kinds import DENSE_MODES, EXPERTS_CHOICES, PLAN_KINDS
from ..export.format_names import EXPORT_FORMAT_NAMES, ExportFormatName

if TYPE_CHECKING:
    from ..checkpoint import CheckpointReader
    from ..checkpoint.source_check import SourceLayout
    from ..dist.plan import DistributionPlan
    from ..export.layouts import ExportFormat
    from ..memory.inventory import CheckpointLayout
    from ..memory.planner import Estimate
    from ..quant.decisions import DecisionTable
    from ..recipe import Recipe
    from ..spec import ModelSpec

__all__ = ["QFORMAT_PRESETS", "LayerwiseSettings", "PtqConfig", "RunPlan", "layerwise_settings", "qformat_names",
           "recipe_name"]

# ``--qformat`` names and their generic recipes; a model's spec may map a name to its own
# (``RecipesSpec.qformat``: e.g. Qwen3-MoE's nvfp4 keeps attention NVFP4, as its engines serve it).
QFORMAT_PRESETS = {
    "nvfp4": "presets/nvfp4",
    "nvfp4_experts_only": "presets/nvfp4_experts_only",
    "w4a16_nvfp4": "presets/w4a16_nvfp4",
    "fp8": "presets/fp8",
}
KV_CACHE_CHOICES = ("none", "fp8")


def qformat_names() -> list[str]:
    """Every ``--qformat`` name: ``QFORMAT_PRESETS`` and ``nvfp4_<preset>`` for each calibration algorithm's preset
    (the registry, quant/calibrators: imported here, not at module import, so this module stays torch-free)."""
    from ..quant.calibrators import qformat_presets

    return [*QFORMAT_PRESETS, *qformat_presets()]


def recipe_name(spec: ModelSpec, qformat: str, recipe: str | None = None) -> str:
    """The recipe ``--recipe``/``--qformat`` mean for this model: ``recipe`` if given; else ``qformat``, a
    ``QFORMAT_PRESETS`` name meaning the model's own recipe for it (``RecipesSpec.qformat``) or the generic one;
    an algorithm's ``nvfp4_<preset>`` meaning the model's mapping for it, else its nvfp4 recipe's
    ``<recipe>_<preset>`` where that file exists, else ``presets/nvfp4_<preset>``; any other text a recipe name
    (hf_ptq and modelopt-k3-plan alike)."""
    if recipe is not None:
        return recipe
    if qformat in QFORMAT_PRESETS:
        return spec.recipes.qformat.get(qformat, QFORMAT_PRESETS[qformat])
    from ..quant.calibrators import qformat_presets

    preset = qformat_presets().get(qformat)
    if preset is None:
        return qformat
    if qformat in spec.recipes.qformat:
        return spec.recipes.qformat[qformat]
    own = spec.recipes.qformat.get("nvfp4")
    if own is not None and _recipe_exists(f"{own}_{preset[0]}"):
        return f"{own}_{preset[0]}"
    return f"presets/nvfp4_{preset[0]}"


def _recipe_exists(name: str) -> bool:
    from ..recipe import RecipeError, RecipeRoots

    try:
        RecipeRoots.current().find_recipe(name)
    except RecipeError:
        return False
    return True


DTYPE_CHOICES = (None, "bfloat16", "float32")
LAYERWISE_CACHE_MIB = 4096  # ``--layerwise_cache_mib``'s default without the environment's


@dataclass(frozen=True, kw_only=True)
class PtqConfig:
    """``modelopt-k3-ptq``'s settings; the field names are the CLI's flags (``--calib_size`` -> ``calib_size``).

    ``PtqConfig.from_namespace(build_parser().parse_args(argv))`` for a command line, or
    ``PtqConfig(pyt_ckpt_path=..., qformat="fp8")`` from Python; values are checked on construction.
    """

    pyt_ckpt_path: Path | None = None  # None: the embedded tiny Kimi-K3 stand-in
    qformat: str = "nvfp4"
    recipe: str | None = None
    kv_cache_qformat: str = "none"
    calib_size: int = 32
    batch_size: int = 4
    calib_seq: int = 128
    dataset: str = "builtin"
    export_path: Path | None = None
    trust_remote_code: bool = False
    calibrate_all_experts: bool = False
    eval_kl: int = 0
    plan: str = "auto"
    dense: str = "replicated"
    ep_degree: int | None = None
    experts: str = "auto"
    gpu_mem_gib: float | None = None
    hardware: str | None = None  # the wall-time note's preset (None: h200-node on a CUDA device, none on a CPU)
    dtype: str | None = None
    overwrite: bool = False
    export_format: ExportFormatName = ExportFormatName.MODELOPT
    target_engines: str | None = None  # comma-separated engine names, as the flag spells them
    max_shard_size_mb: int = 5 * 1024
    allow_nonfinite_passthrough: bool = False
    allow_unmatched: bool = False
    report: str | None = None  # None: EXPORT/quant_report; "none": no report
    report_heldout: int | None = None
    min_expert_tokens: int = 1
    uncovered_experts: str = "refuse"
    layerwise: bool = False  # also a recipe's algorithm.layerwise.enable
    layerwise_checkpoint_dir: Path | None = None  # also algorithm.layerwise.checkpoint_dir
    # Host memory a layer's captured inputs may take before they spill to disk (the CLI's default:
    # $MODELOPT_K3_LAYERWISE_CACHE_MIB, read by the parser; a stage never reads it).
    layerwise_cache_mib: int = LAYERWISE_CACHE_MIB
    debug: bool = False
    no_progress: bool = False

    def __post_init__(self) -> None:
        for name in ("calib_size", "batch_size", "calib_seq", "max_shard_size_mb", "layerwise_cache_mib"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("eval_kl", "min_expert_tokens", "report_heldout"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value}")
        if self.ep_degree is not None and self.ep_degree < 1:
            raise ValueError(f"ep_degree must be a positive integer, got {self.ep_degree}")
        from ..quant.coverage import POLICIES

        for name, choices in (("plan", PLAN_KINDS), ("dense", DENSE_MODES), ("experts", EXPERTS_CHOICES),
                              ("kv_cache_qformat", KV_CACHE_CHOICES), ("dtype", DTYPE_CHOICES),
                              ("export_format", EXPORT_FORMAT_NAMES), ("uncovered_experts", POLICIES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose one of {list(choices)}")
        object.__setattr__(self, "export_format", ExportFormatName(self.export_format))
        for name in ("pyt_ckpt_path", "export_path", "layerwise_checkpoint_dir"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))

    @classmethod
    def from_namespace(cls, args: Any) -> PtqConfig:
        """The config of parsed CLI arguments (``hf_ptq.build_parser().parse_args``)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(vars(args)) - names)
        if unknown:  # a flag the config does not carry would be silently dropped
            raise ValueError(f"PtqConfig has no field for {', '.join(unknown)}")
        return cls(**vars(args))

    def recipe_name(self, spec: ModelSpec) -> str:
        """The recipe this run means (``recipe_name``)."""
        return recipe_name(spec, self.qformat, self.recipe)

    def recipe_overrides(self) -> dict[str, Any] | None:
        """What the flags change in the recipe (``--kv_cache_qformat``, ``--calibrate_all_experts``,
        ``--allow_unmatched``), None: nothing."""
        overrides: dict[str, Any] = {}
        if self.kv_cache_qformat != "none":
            overrides["kv_cache"] = self.kv_cache_qformat
        if self.calibrate_every_expert:
            overrides["calibrate_all_experts"] = True
        if self.allow_unmatched:
            overrides["allow_unmatched"] = True
        return overrides or None

    @property
    def held_out_asked(self) -> int:
        """Held-out sequences the flags ask for: ``max(--report_heldout, --eval_kl)`` (the run adds one per rank
        for a report when neither is given: ``hf_ptq._held_out_count``)."""
        return max(self.report_heldout or 0, self.eval_kl)

    @property
    def calibrate_every_expert(self) -> bool:
        """``--calibrate_all_experts``, also asked through ``--uncovered_experts calibrate_all``."""
        return self.calibrate_all_experts or self.uncovered_experts == "calibrate_all"


@dataclass(frozen=True)
class LayerwiseSettings:
    """A run's layerwise choice (``--layerwise`` or the recipe's ``algorithm.layerwise``), decided once."""

    checkpoint_dir: Path | None  # None: a temporary directory, removed when the run ends
    qdq_inputs: bool  # each layer's inputs from the quantized layers before it (GPTQ), else unquantized
    cache_mib: int = LAYERWISE_CACHE_MIB  # captured inputs held in host memory up to this, then spilled

    @property
    def cache_bytes(self) -> int:
        return self.cache_mib * 2**20


def layerwise_settings(config: PtqConfig, recipe: Recipe) -> LayerwiseSettings | None:
    """The layerwise settings of ``config`` with ``recipe`` (the flags win over the recipe), None: resident."""
    lw = recipe.algorithm.layerwise
    if not (config.layerwise or lw.enable):
        if config.layerwise_checkpoint_dir is not None:
            raise ValueError("--layerwise_checkpoint_dir needs --layerwise (or the recipe's layerwise.enable: true)")
        return None
    ckpt = config.layerwise_checkpoint_dir or (Path(lw.checkpoint_dir) if lw.checkpoint_dir else None)
    from ..quant.calibrators import qdq_inputs  # the algorithm's default (the registry)

    return LayerwiseSettings(ckpt, qdq_inputs(recipe.algorithm), config.layerwise_cache_mib)


@dataclass(frozen=True)
class RunPlan:
    """Everything decided about one run before a weight is read, once, by the preflight (on every rank: its
    own rank's plan). Stages take it (or the part they need) as an argument and never re-derive it."""

    config: PtqConfig
    checkpoint: Path
    trust_remote_code: bool
    export_path: Path | None  # None: a library load's plan (``planning.plan_library_load``), no export
    export_format: ExportFormat  # the registered format ``config.export_format`` names
    raw_config: dict  # the checkpoint's config.json
    spec: ModelSpec
    reader: CheckpointReader  # the one reader of the source: its headers, read and checked once
    source: SourceLayout  # the routed experts as stored (checked against config.json; packed or not)
    layout: CheckpointLayout  # the memory planner's view of the same headers
    recipe: Recipe
    table: DecisionTable  # from the headers; quantize adds the shared-input groups (the model's code)
    distribution: DistributionPlan  # validated, with its experts residency (an enum) and decode chunk
    memory: Estimate  # the planner's estimate of ``distribution`` at this run's calibration shape
    texts: list[str]  # the calibration texts
    dtype: Any = None  # the load dtype (a torch.dtype: --dtype, else config.json's), decided once
    held_out: int = 0  # held-out sequences after the calibration ones (report / --eval_kl)
    layerwise: LayerwiseSettings | None = None  # one decoder layer at a time (None: resident)
    report_dir: Path | None = None  # where the quantization report goes (None: no report)

    @property
    def packed_source(self) -> bool:
        """Whether the routed experts are stored MXFP4-packed (``source_check``: decided once)."""
        return self.source.packed_experts
