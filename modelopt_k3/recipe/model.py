"""The recipe data model: what one Linear gets (``QuantFormat``), one pattern entry, and a whole recipe.

No files, no YAML: ``finder`` locates recipe files, ``parser`` turns them into these objects.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..numerics.constants import NVFP4_BLOCK

WEIGHT_FORMATS = ("nvfp4", "fp8", "fp8_pb")
INPUT_FORMATS = ("nvfp4", "fp8")
ALGORITHMS = ("max",)
KV_CACHE_FORMATS = ("fp8",)

# (weights, inputs) -> ModelOpt quant_algo name written to hf_quant_config.json.
_ALGOS: dict[tuple[str, str | None], str] = {
    ("nvfp4", "nvfp4"): "NVFP4",
    ("nvfp4", None): "W4A16_NVFP4",
    ("fp8", "fp8"): "FP8",
    ("fp8_pb", None): "FP8_PB_WO",
}


class RecipeError(ValueError):
    """A recipe file, override or recipe/model pairing is invalid; the message names where and why."""


@dataclass(frozen=True)
class QuantFormat:
    """What one Linear gets. ``weights=None`` means disabled (stays BF16)."""

    weights: str | None
    inputs: str | None
    input_amax: float | None = None

    def __post_init__(self) -> None:
        if self.weights is None:
            if self.inputs is not None or self.input_amax is not None:
                raise ValueError("a disabled format (weights=None) takes no inputs or input_amax")
            return
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights {self.weights!r} is not one of {list(WEIGHT_FORMATS)}")
        if self.inputs is not None and self.inputs not in INPUT_FORMATS:
            raise ValueError(f"inputs {self.inputs!r} is not one of {list(INPUT_FORMATS)} or null")
        if (self.weights, self.inputs) not in _ALGOS:
            allowed = ", ".join(f"{w}+{i or 'null'}" for w, i in _ALGOS)
            raise ValueError(
                f"weights={self.weights} with inputs={self.inputs or 'null'} has no ModelOpt quant_algo; "
                f"allowed (weights+inputs): {allowed}"
            )
        if self.input_amax is not None:
            if self.inputs is None:
                raise ValueError("input_amax needs quantized inputs, but inputs is null (weight-only)")
            amax = self.input_amax
            if isinstance(amax, bool) or not isinstance(amax, (int, float)):
                raise ValueError(f"input_amax must be a number, got {amax!r} ({type(amax).__name__})")
            if not math.isfinite(amax) or amax <= 0:
                raise ValueError(f"input_amax must be a finite number > 0, got {amax!r}")
            object.__setattr__(self, "input_amax", float(amax))

    @property
    def enabled(self) -> bool:
        return self.weights is not None

    @property
    def algo(self) -> str:
        """ModelOpt ``quant_algo`` name (see the module docstring's table)."""
        if self.weights is None:
            raise ValueError("a disabled format has no quant_algo")
        return _ALGOS[(self.weights, self.inputs)]

    @property
    def group_size(self) -> int | None:
        """Weight block length along in_features for NVFP4 (16); None otherwise."""
        return NVFP4_BLOCK if self.weights == "nvfp4" else None

    @property
    def needs_calibration(self) -> bool:
        """True when an input scale must come from observed activations."""
        return self.inputs is not None and self.input_amax is None

    def __str__(self) -> str:
        if not self.enabled:
            return "bf16"
        text = self.algo
        if self.input_amax is not None:
            text += f" (input_amax={self.input_amax:g})"
        return text


DISABLED = QuantFormat(None, None)
NVFP4 = QuantFormat("nvfp4", "nvfp4")
W4A16_NVFP4 = QuantFormat("nvfp4", None)
FP8 = QuantFormat("fp8", "fp8")
FP8_PB_WO = QuantFormat("fp8_pb", None)


@dataclass(frozen=True)
class RecipeEntry:
    pattern: str
    format: QuantFormat
    reason: str | None = None
    must_match: bool = False
    source: str = "<code>"
    _regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regex", re.compile(fnmatch.translate(self.pattern)))

    def matches(self, module_name: str) -> bool:
        return self._regex.match(module_name) is not None


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path | None
    entries: tuple[RecipeEntry, ...]
    algorithm: str = "max"
    kv_cache: str | None = None
    calibrate_all_experts: bool = False
    description: str | None = None

    def resolve(self, module_name: str) -> tuple[QuantFormat | None, RecipeEntry | None]:
        """The last entry matching ``module_name`` and its format; format None = leave BF16."""
        for entry in reversed(self.entries):
            if entry.matches(module_name):
                return (entry.format if entry.format.enabled else None), entry
        return None, None

    def needs_calibration(self, module_names: Iterable[str]) -> bool:
        """Whether quantizing these modules (or the KV cache) needs calibration data."""
        if self.kv_cache is not None:
            return True
        for name in module_names:
            fmt, _ = self.resolve(name)
            if fmt is not None and fmt.needs_calibration:
                return True
        return False

    def check_against(self, module_names_with_shapes: Mapping[str, tuple[int, int]]) -> None:
        """Validate against a model's quantizable modules, ``{name: (out_features, in_features)}``.

        Checks that every ``must_match`` pattern matches some module, and that every module's
        format can take its shape (NVFP4 needs in_features % 16 == 0; FP8 and 128x128 block
        FP8 take any shape, block FP8 with partial edge blocks). Raises one RecipeError
        listing every problem.
        """
        problems: list[str] = []
        for entry in self.entries:
            if entry.must_match and not any(entry.matches(n) for n in module_names_with_shapes):
                problems.append(
                    f"{entry.source} pattern {entry.pattern!r}: must_match is set but the pattern matches "
                    f"none of the model's {len(module_names_with_shapes)} quantizable modules"
                )
        for name, shape in module_names_with_shapes.items():
            fmt, entry = self.resolve(name)
            if fmt is None or fmt.weights != "nvfp4":
                continue
            out_features, in_features = shape
            if in_features % NVFP4_BLOCK:
                problems.append(
                    f"{entry.source} pattern {entry.pattern!r}: layer {name} in_features={in_features} is not "
                    f"divisible by {NVFP4_BLOCK}, NVFP4 cannot take it (disable it in a later entry "
                    f"or give it fp8_pb)"
                )
        if problems:
            shown = problems[:20]
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise RecipeError(
                f"recipe {self.name!r} does not fit the model:\n  " + "\n  ".join(shown) + more
            )

    def summary(self, module_names: Iterable[str]) -> str:
        """One line per (format, deciding entry) with module counts, disabled reasons included."""
        counts: Counter[tuple[str, str]] = Counter()
        for name in module_names:
            fmt, entry = self.resolve(name)
            if entry is None:
                key = ("bf16", "no entry matches")
            else:
                what = f"{entry.source} {entry.pattern!r}"
                if entry.reason:
                    what += f" ({entry.reason})"
                key = (str(fmt) if fmt is not None else "bf16", what)
            counts[key] += 1
        lines = [f"recipe {self.name}: algorithm={self.algorithm} kv_cache={self.kv_cache}"]
        for (fmt_text, what), n in sorted(counts.items()):
            lines.append(f"  {n:7d}  {fmt_text:<28} {what}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A plain, import-free recipe dict (for metadata); ``recipe_from_dict`` reads it back."""
        quant_cfg = []
        for e in self.entries:
            item: dict[str, Any] = {"pattern": e.pattern}
            if e.format.enabled:
                item["weights"] = e.format.weights
                item["inputs"] = e.format.inputs
                if e.format.input_amax is not None:
                    item["input_amax"] = e.format.input_amax
            else:
                item["enable"] = False
            if e.must_match:
                item["must_match"] = True
            if e.reason:
                item["reason"] = e.reason
            quant_cfg.append(item)
        out: dict[str, Any] = {
            "algorithm": self.algorithm,
            "kv_cache": self.kv_cache,
            "calibrate_all_experts": self.calibrate_all_experts,
            "quant_cfg": quant_cfg,
        }
        if self.description:
            out["description"] = self.description
        return out
