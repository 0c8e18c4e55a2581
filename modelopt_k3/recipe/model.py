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

from ..quant.schemes import (
    FP8_BLOCK_TENSOR,
    FP8_TENSOR,
    INPUT_FORMAT_NAMES,
    KV_CACHE_FORMAT_NAMES,
    NVFP4_TENSOR,
    WEIGHT_FORMAT_NAMES,
    KvCacheFormat,
    Scheme,
    TensorFormat,
    scheme_for,
    tensor_format,
)
from .algorithm import MAX, Algorithm

# The registry's keys, as recipes spell them (modelopt_k3/quant/schemes.py owns the formats).
WEIGHT_FORMATS = WEIGHT_FORMAT_NAMES
INPUT_FORMATS = INPUT_FORMAT_NAMES
KV_CACHE_FORMATS = KV_CACHE_FORMAT_NAMES


class RecipeError(ValueError):
    """A recipe file, override or recipe/model pairing is invalid; the message names where and why."""


@dataclass(frozen=True)
class QuantFormat:
    """What one Linear gets. ``weights=None`` means disabled (stays BF16).

    ``weights``/``inputs`` are registry formats (``modelopt_k3.quant.schemes``); a recipe name given here is
    resolved once, on construction (the parser builds every QuantFormat), and never again downstream.
    """

    weights: TensorFormat | None
    inputs: TensorFormat | None
    input_amax: float | None = None
    scheme: Scheme | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if self.weights is None:
            if self.inputs is not None or self.input_amax is not None:
                raise ValueError("a disabled format (weights=None) takes no inputs or input_amax")
            return
        weights = tensor_format(self.weights, role="weights")
        inputs = None if self.inputs is None else tensor_format(self.inputs, role="inputs")
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "inputs", inputs)
        object.__setattr__(self, "scheme", scheme_for(weights, inputs))
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
        """ModelOpt ``quant_algo`` name (the registry's ``Scheme.algo``)."""
        if self.scheme is None:
            raise ValueError("a disabled format has no quant_algo")
        return self.scheme.algo

    @property
    def group_size(self) -> int | None:
        """Weight block length along in_features (NVFP4: 16); None otherwise."""
        return self.weights.group_size if self.weights is not None else None

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
NVFP4 = QuantFormat(NVFP4_TENSOR, NVFP4_TENSOR)
W4A16_NVFP4 = QuantFormat(NVFP4_TENSOR, None)
FP8 = QuantFormat(FP8_TENSOR, FP8_TENSOR)
FP8_PB_WO = QuantFormat(FP8_BLOCK_TENSOR, None)


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
    algorithm: Algorithm = MAX  # compares equal to "max" (recipe/algorithm.py)
    kv_cache: KvCacheFormat | None = None
    calibrate_all_experts: bool = False
    description: str | None = None
    # A run's choice (--allow_unmatched), not part of the recipe: a pattern that matches no module passes.
    allow_unmatched: bool = field(default=False, compare=False)

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

    def check_against(
        self, module_names_with_shapes: Mapping[str, tuple[int, int]], other_modules: Iterable[str] = ()
    ) -> None:
        """Validate against a model's quantizable modules, ``{name: (out_features, in_features)}`` (and
        ``other_modules``: the names of its other modules, norms, embeddings, convolutions, routers).

        Every pattern must match some module, or it is refused by name (a typo such as ``*self_atn*``
        would otherwise quantize nothing without a word): a ``must_match`` entry always; unless
        ``allow_unmatched``, every entry that enables quantization (matching a quantizable module) and
        every entry written in the recipe itself (any module). Disabled entries of imported units may
        match nothing: they are shared safety nets naming modules of other models. And every module's
        format can take its shape (NVFP4 needs in_features % 16 == 0; FP8 and 128x128 block FP8 take
        any shape, block FP8 with partial edge blocks). Raises one RecipeError listing every problem.
        """
        problems: list[str] = []
        quantizable = list(module_names_with_shapes)
        everything = [*quantizable, *other_modules]
        for entry in self.entries:
            enabled, own = entry.format.enabled, "(imported at " not in entry.source
            if entry.must_match and not any(entry.matches(n) for n in quantizable):
                problems.append(
                    f"{entry.source} pattern {entry.pattern!r}: must_match is set but the pattern matches "
                    f"none of the model's {len(module_names_with_shapes)} quantizable modules"
                )
            elif not self.allow_unmatched and (enabled or own) and not entry.must_match:
                names = quantizable if enabled else everything
                if not any(entry.matches(n) for n in names):
                    what = f"{len(quantizable)} quantizable modules" if enabled else f"{len(names)} modules"
                    problems.append(f"{entry.source} pattern {entry.pattern!r} matches none of the model's {what} "
                                    "(a typo?); fix the pattern, or pass --allow_unmatched to run anyway")
        for name, shape in module_names_with_shapes.items():
            fmt, entry = self.resolve(name)
            if fmt is None:
                continue
            out_features, in_features = shape
            multiple = fmt.weights.in_features_multiple
            if in_features % multiple:
                problems.append(
                    f"{entry.source} pattern {entry.pattern!r}: layer {name} in_features={in_features} is not "
                    f"divisible by {multiple}, {fmt.weights.name.upper()} cannot take it (disable it in a later "
                    f"entry or give it fp8_pb)"
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
                item["weights"] = e.format.weights.name
                item["inputs"] = e.format.inputs.name if e.format.inputs is not None else None
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
            "algorithm": self.algorithm.to_recipe(),
            "kv_cache": self.kv_cache.name if self.kv_cache is not None else None,
            "calibrate_all_experts": self.calibrate_all_experts,
            "quant_cfg": quant_cfg,
        }
        if self.description:
            out["description"] = self.description
        return out
