"""YAML quantization recipes: loading, the data model, and validation.

A recipe says, by fnmatch-style patterns on the checkpoint's module names, which
format each quantizable Linear gets. Patterns match the whole name, case-sensitively,
and ``*`` spans dots: ``*.block_sparse_moe.gate`` matches
``language_model.model.layers.1.block_sparse_moe.gate`` but not ``...shared_experts.gate_proj``.
Entries are applied in order and the LAST matching entry wins; a name no entry
matches stays BF16.

Schema of a recipe file (recipes/README.md has the same text with examples)::

    description: free text                  # optional
    imports: [units/some_unit]              # optional; spliced BEFORE quant_cfg[0]
    algorithm: max                          # optional, default max (the only one)
    kv_cache: fp8                           # optional: null (default) | fp8
    calibrate_all_experts: false            # optional, default false
    quant_cfg:                              # list of entries and imports
      - pattern: "*"                        # required
        weights: nvfp4                      # nvfp4 | fp8 | fp8_pb
        inputs: nvfp4                       # required with weights: nvfp4 | fp8 | null (weight-only)
        input_amax: 2688.0                  # optional constant activation amax (no calibration)
        must_match: false                   # optional: error if it matches no quantizable module
        reason: text                        # optional note (shown in the summary)
      - pattern: "*.block_sparse_moe.gate"
        enable: false                       # leave BF16; takes no format keys
        reason: router
      - pattern: "*.mlp.*"
        scheme: NVFP4                       # alias: a compressed-tensors preset name, instead of weights/inputs
      - import: units/default_disabled      # splice that file's entries HERE

Import rule: an import's entries are spliced in where the import stands. The top-level
``imports`` list stands before ``quant_cfg[0]``; an ``- import: X`` item stands at its own
position in ``quant_cfg``. Since later entries win, put ``- import: units/default_disabled``
after a ``"*"`` entry so that the disabled entries override it. An imported file is a unit: it
may hold only ``description``, ``imports`` and ``quant_cfg``. Import paths (with or without
``.yaml``) starting with ``.`` are relative to the importing file; others are looked up in the
recipes roots, then relative to the importing file. Absolute paths are taken as they are.

Format combinations and the ModelOpt ``quant_algo`` each exports as (``QuantFormat.algo``):

    weights  inputs  quant_algo
    nvfp4    nvfp4   NVFP4         W4A4, per-16 E4M3 block scales + FP32 global scale
    nvfp4    null    W4A16_NVFP4   weight-only NVFP4
    fp8      fp8     FP8           per-tensor E4M3 weights and inputs
    fp8_pb   null    FP8_PB_WO     128x128 block FP8 weights, weight-only (edge blocks may be partial)

Other combinations are refused: ModelOpt has no name for per-tensor FP8 weight-only, its
FP8_PB_REAL uses dynamic per-group inputs that this project does not produce, and nothing
here writes W4A8_NVFP4_FP8.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "DISABLED",
    "FP8",
    "FP8_PB_WO",
    "NVFP4",
    "W4A16_NVFP4",
    "QuantFormat",
    "Recipe",
    "RecipeEntry",
    "RecipeError",
    "available_presets",
    "load_recipe",
    "parse_overrides",
    "recipe_from_dict",
    "recipes_roots",
]

WEIGHT_FORMATS = ("nvfp4", "fp8", "fp8_pb")
INPUT_FORMATS = ("nvfp4", "fp8")
ALGORITHMS = ("max",)
KV_CACHE_FORMATS = ("fp8",)
NVFP4_GROUP_SIZE = 16
FP8_PB_BLOCK = (128, 128)

# (weights, inputs) -> ModelOpt quant_algo name written to hf_quant_config.json.
_ALGOS: dict[tuple[str, str | None], str] = {
    ("nvfp4", "nvfp4"): "NVFP4",
    ("nvfp4", None): "W4A16_NVFP4",
    ("fp8", "fp8"): "FP8",
    ("fp8_pb", None): "FP8_PB_WO",
}

_RECIPE_KEYS = ("description", "imports", "algorithm", "kv_cache", "calibrate_all_experts", "quant_cfg")
_UNIT_KEYS = ("description", "imports", "quant_cfg")
_OVERRIDE_KEYS = ("name", "algorithm", "kv_cache", "calibrate_all_experts", "quant_cfg")
_ENTRY_KEYS = (
    "pattern", "enable", "weights", "inputs", "input_amax", "scheme", "must_match", "reason",
)
_FORMAT_KEYS = ("weights", "inputs", "input_amax", "scheme")
_YAML_SUFFIXES = (".yaml", ".yml")


class RecipeError(ValueError):
    """A recipe file, override or recipe/model pairing is invalid; the message names where and why."""


# --------------------------------------------------------------------------- data model


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
        return NVFP4_GROUP_SIZE if self.weights == "nvfp4" else None

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
            if in_features % NVFP4_GROUP_SIZE:
                problems.append(
                    f"{entry.source} pattern {entry.pattern!r}: layer {name} in_features={in_features} is not "
                    f"divisible by {NVFP4_GROUP_SIZE}, NVFP4 cannot take it (disable it in a later entry "
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


# --------------------------------------------------------------------------- locating files


def recipes_roots() -> list[Path]:
    """Directories searched for recipe names: $MODELOPT_K3_RECIPES entries first, then the built-in one."""
    roots: list[Path] = []
    for part in os.environ.get("MODELOPT_K3_RECIPES", "").split(os.pathsep):
        if part.strip():
            roots.append(Path(part.strip()).expanduser().resolve())
    here = Path(__file__).resolve().parent
    # The repository's top-level recipes/ (source checkout, editable install); a packaged copy
    # inside the package wins if one was installed there.
    for candidate in (here / "recipes", here.parent / "recipes"):
        if candidate.is_dir():
            roots.append(candidate)
    return list(dict.fromkeys(roots))


def available_presets() -> list[str]:
    names: set[str] = set()
    for root in recipes_roots():
        presets = root / "presets"
        if presets.is_dir():
            names.update(p.stem for p in presets.iterdir() if p.suffix in _YAML_SUFFIXES)
    return sorted(names)


def _display(path: Path) -> str:
    """How a file is named in messages: 'recipes/presets/nvfp4.yaml' for files under a root."""
    for root in recipes_roots():
        try:
            return f"{root.name}/{path.relative_to(root).as_posix()}"
        except ValueError:
            continue
    return str(path)


def _candidates(base: Path, name: str) -> list[Path]:
    path = base / name
    out = [path]
    if path.suffix not in _YAML_SUFFIXES:
        out += [path.with_name(path.name + s) for s in _YAML_SUFFIXES]
    return out


def _first_file(paths: Iterable[Path]) -> Path | None:
    for p in paths:
        if p.is_file():
            return p.resolve()
    return None


def _find_recipe(name_or_path: str | Path) -> Path:
    direct = Path(name_or_path).expanduser()
    if direct.is_file():
        return direct.resolve()
    name = str(name_or_path)
    tried: list[Path] = []
    for root in recipes_roots():
        for base in (root, root / "presets"):
            cands = _candidates(base, name)
            tried += cands
            found = _first_file(cands)
            if found is not None:
                return found
    raise RecipeError(
        f"recipe {name!r} not found: not a file, and not under any recipes root "
        f"({', '.join(str(r) for r in recipes_roots()) or 'none'}) as-is or under presets/. "
        f"Available presets: {', '.join(available_presets()) or 'none'}"
    )


def _find_import(spec: str, importer: Path | None, where: str) -> Path:
    raw = Path(spec).expanduser()
    here = importer.parent if importer is not None else None
    if raw.is_absolute():
        bases = [Path("/")]
    elif spec.startswith("."):
        bases = [here] if here is not None else [Path.cwd()]
    else:
        bases = recipes_roots() + ([here] if here is not None else [])
    tried = [c for b in bases for c in _candidates(b, spec)]
    found = _first_file(tried)
    if found is None:
        raise RecipeError(
            f"{where}: import {spec!r} not found; tried: {', '.join(str(t) for t in tried)}"
        )
    return found


# --------------------------------------------------------------------------- parsing


def _read_yaml(path: Path, chain: tuple[str, ...]) -> dict[str, Any]:
    shown = _display(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RecipeError(f"{shown}: cannot read: {exc}") from exc
    try:
        # safe_load only: recipe files are data; tags such as !!python/object are refused.
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        via = f" (imported via {' -> '.join(chain)})" if chain else ""
        raise RecipeError(f"{shown}{via}: not valid (safe) YAML: {exc}") from exc
    if data is None:
        raise RecipeError(f"{shown}: the file is empty")
    if not isinstance(data, dict):
        raise RecipeError(f"{shown}: the top level must be a mapping, got {type(data).__name__}")
    return data


def _check_keys(data: Mapping[str, Any], allowed: tuple[str, ...], where: str, what: str) -> None:
    for key in data:
        if key not in allowed:
            raise RecipeError(
                f"{where}: unknown key {key!r} in {what}; allowed keys: {', '.join(allowed)}"
            )


def _want(value: Any, types: type | tuple[type, ...], where: str, key: str, expect: str) -> Any:
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise RecipeError(f"{where}: {key} must be {expect}, got {value!r}")
    if not isinstance(value, types):
        raise RecipeError(f"{where}: {key} must be {expect}, got {value!r} ({type(value).__name__})")
    return value


def _format_name(value: Any, allowed: tuple[str, ...], where: str, key: str, nullable: bool) -> str | None:
    if value is None and nullable:
        return None
    expect = " | ".join(allowed) + (" | null" if nullable else "")
    if not isinstance(value, str) or value.lower() not in allowed:
        raise RecipeError(f"{where}: {key}: unknown format {value!r}; expected {expect}")
    return value.lower()


def _scheme_to_format(name: str, where: str) -> QuantFormat:
    """Map a compressed-tensors preset scheme name onto our format vocabulary.

    We keep our own small vocabulary (nvfp4 / fp8 / fp8_pb) rather than storing
    QuantizationScheme objects because export must name each layer by its ModelOpt
    quant_algo, and only a handful of schemes have one; the compressed-tensors parser
    is used so that its preset names mean exactly what they mean there.
    """
    from compressed_tensors.quantization import preset_name_to_scheme  # heavy (torch): import lazily

    try:
        scheme = preset_name_to_scheme(name.upper(), ["Linear"])
    except Exception as exc:  # compressed-tensors raises KeyError/ValueError for unknown names
        raise RecipeError(f"{where}: scheme {name!r} is not a compressed-tensors preset scheme ({exc})") from exc

    def kind(args: Any, role: str) -> str | None:
        if args is None:
            return None
        strategy = getattr(args.strategy, "value", args.strategy)
        if args.type == "float" and args.num_bits == 4 and strategy == "tensor_group" and args.group_size == 16:
            return "nvfp4"
        if args.type == "float" and args.num_bits == 8 and strategy == "tensor" and not args.dynamic:
            return "fp8"
        if (role == "weights" and args.type == "float" and args.num_bits == 8 and strategy == "block"
                and list(args.block_structure or []) == list(FP8_PB_BLOCK)):
            return "fp8_pb"
        raise RecipeError(
            f"{where}: scheme {name!r}: its {role} ({args.num_bits}-bit {args.type}, strategy {strategy}"
            f"{', dynamic' if args.dynamic is True else ''}) have no counterpart here; "
            f"use weights/inputs with {list(WEIGHT_FORMATS)} instead"
        )

    weights = kind(scheme.weights, "weights")
    inputs = kind(scheme.input_activations, "inputs")
    if weights is None:
        raise RecipeError(f"{where}: scheme {name!r} does not quantize weights; use enable: false to skip")
    try:
        return QuantFormat(weights, inputs)
    except ValueError as exc:
        raise RecipeError(f"{where}: scheme {name!r}: {exc}") from exc


def _parse_entry(item: Mapping[str, Any], where: str) -> RecipeEntry:
    _check_keys(item, _ENTRY_KEYS, where, "a quant_cfg entry")
    if "pattern" not in item:
        raise RecipeError(f"{where}: entry has no 'pattern'")
    pattern = _want(item["pattern"], str, where, "pattern", "a string")
    if not pattern:
        raise RecipeError(f"{where}: pattern is empty")
    where_p = f"{where} pattern {pattern!r}"
    enable = _want(item.get("enable", True), bool, where_p, "enable", "true or false")
    must_match = _want(item.get("must_match", False), bool, where_p, "must_match", "true or false")
    reason = item.get("reason")
    if reason is not None:
        reason = _want(reason, str, where_p, "reason", "a string")

    given = [k for k in _FORMAT_KEYS if k in item]
    if not enable:
        if given:
            raise RecipeError(f"{where_p}: a disabled entry (enable: false) takes no {', '.join(given)}")
        return RecipeEntry(pattern, DISABLED, reason, must_match, where)

    if "scheme" in item:
        clash = [k for k in ("weights", "inputs") if k in item]
        if clash:
            raise RecipeError(f"{where_p}: give either scheme or {'/'.join(clash)}, not both")
        scheme = _want(item["scheme"], str, where_p, "scheme", "a preset scheme name")
        fmt = _scheme_to_format(scheme, where_p)
        weights, inputs = fmt.weights, fmt.inputs
    else:
        if "weights" not in item:
            raise RecipeError(
                f"{where_p}: an enabled entry needs weights (or scheme); write enable: false to leave BF16"
            )
        if "inputs" not in item:
            raise RecipeError(
                f"{where_p}: weights is set but inputs is not; write inputs: null for weight-only"
            )
        weights = _format_name(item["weights"], WEIGHT_FORMATS, where_p, "weights", nullable=False)
        inputs = _format_name(item["inputs"], INPUT_FORMATS, where_p, "inputs", nullable=True)
    amax = item.get("input_amax")
    if isinstance(amax, str):
        raise RecipeError(
            f"{where_p}: input_amax must be a number, got the string {amax!r} "
            f"(YAML reads 1e3 as a string; write 1000.0 or 1.0e+3)"
        )
    try:
        fmt = QuantFormat(weights, inputs, amax)
    except ValueError as exc:
        raise RecipeError(f"{where_p}: {exc}") from exc
    return RecipeEntry(pattern, fmt, reason, must_match, where)


def _parse_quant_cfg(
    items: Any, where: str, importer: Path | None, chain: tuple[Path, ...]
) -> list[RecipeEntry]:
    if items is None:
        return []
    if not isinstance(items, list):
        raise RecipeError(f"{where}: quant_cfg must be a list of entries, got {type(items).__name__}")
    out: list[RecipeEntry] = []
    for i, item in enumerate(items):
        here = f"{where}: quant_cfg[{i}]"
        if not isinstance(item, dict):
            raise RecipeError(f"{here}: an entry must be a mapping, got {item!r}")
        if "import" in item:
            if len(item) != 1:
                extra = sorted(k for k in item if k != "import")
                raise RecipeError(f"{here}: an import item takes only the key 'import', also got {extra}")
            out += _import(item["import"], here, importer, chain)
        else:
            out.append(_parse_entry(item, here))
    return out


def _import(spec: Any, where: str, importer: Path | None, chain: tuple[Path, ...]) -> list[RecipeEntry]:
    spec = _want(spec, str, where, "import", "a recipe path")
    path = _find_import(spec, importer, where)
    if path in chain:
        cycle = " -> ".join(_display(p) for p in (*chain, path))
        raise RecipeError(f"{where}: circular import: {cycle}")
    data = _read_yaml(path, tuple(_display(p) for p in chain))
    shown = _display(path)
    _check_keys(data, _UNIT_KEYS, shown, "an imported unit (a unit holds only quant_cfg and imports)")
    entries = _parse_file_entries(data, shown, path, (*chain, path))
    # Tag imported entries with who imported them, so errors trace back to the recipe.
    return [
        RecipeEntry(e.pattern, e.format, e.reason, e.must_match, f"{e.source} (imported at {where})")
        for e in entries
    ]


def _parse_file_entries(
    data: Mapping[str, Any], shown: str, path: Path | None, chain: tuple[Path, ...]
) -> list[RecipeEntry]:
    entries: list[RecipeEntry] = []
    imports = data.get("imports")
    if imports is not None:
        if isinstance(imports, str):
            imports = [imports]
        if not isinstance(imports, list):
            raise RecipeError(f"{shown}: imports must be a list of paths, got {type(imports).__name__}")
        for i, spec in enumerate(imports):
            entries += _import(spec, f"{shown}: imports[{i}]", path, chain)
    entries += _parse_quant_cfg(data.get("quant_cfg"), shown, path, chain)
    return entries


def _settings(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "algorithm" in data:
        algo = data["algorithm"]
        if not isinstance(algo, str) or algo.lower() not in ALGORITHMS:
            raise RecipeError(f"{where}: algorithm {algo!r} is not supported; expected one of {list(ALGORITHMS)}")
        out["algorithm"] = algo.lower()
    if "kv_cache" in data:
        kv = data["kv_cache"]
        if isinstance(kv, str) and kv.lower() == "none":
            kv = None
        if kv is not None and (not isinstance(kv, str) or kv.lower() not in KV_CACHE_FORMATS):
            raise RecipeError(f"{where}: kv_cache {kv!r} is not supported; expected null or one of "
                              f"{list(KV_CACHE_FORMATS)}")
        out["kv_cache"] = kv.lower() if kv is not None else None
    if "calibrate_all_experts" in data:
        out["calibrate_all_experts"] = _want(
            data["calibrate_all_experts"], bool, where, "calibrate_all_experts", "true or false"
        )
    if data.get("description") is not None:
        out["description"] = _want(data["description"], str, where, "description", "a string")
    return out


def _build(
    data: Mapping[str, Any], *, name: str, path: Path | None, shown: str, overrides: Mapping[str, Any] | None
) -> Recipe:
    _check_keys(data, _RECIPE_KEYS, shown, "a recipe")
    settings = _settings(data, shown)
    entries = _parse_file_entries(data, shown, path, (path,) if path is not None else ())
    if overrides:
        if not isinstance(overrides, Mapping):
            raise RecipeError(f"overrides must be a mapping, got {type(overrides).__name__}")
        _check_keys(overrides, _OVERRIDE_KEYS, "overrides", "recipe overrides")
        settings.update(_settings(overrides, "overrides"))
        if "name" in overrides:
            name = _want(overrides["name"], str, "overrides", "name", "a string")
        # Override entries are appended, so they win over the file's.
        entries += _parse_quant_cfg(overrides.get("quant_cfg"), "overrides", None, ())
    if not entries:
        raise RecipeError(f"{shown}: the recipe has no quant_cfg entries")
    return Recipe(name=name, path=path, entries=tuple(entries), **settings)


# --------------------------------------------------------------------------- public entry points


def load_recipe(name_or_path: str | Path, *, overrides: Mapping[str, Any] | None = None) -> Recipe:
    """Load a recipe by file path, or by name under a recipes root (as-is, then under presets/).

    ``overrides`` takes the recipe keys ``algorithm``, ``kv_cache``, ``calibrate_all_experts``
    and ``name`` (replacing the file's) and ``quant_cfg`` (appended, so its entries win).
    """
    path = _find_recipe(name_or_path)
    shown = _display(path)
    data = _read_yaml(path, ())
    name = path.stem
    for root in recipes_roots():
        try:
            name = path.relative_to(root).with_suffix("").as_posix()
            break
        except ValueError:
            continue
    return _build(data, name=name, path=path, shown=shown, overrides=overrides)


def recipe_from_dict(
    data: Mapping[str, Any], *, name: str = "inline", overrides: Mapping[str, Any] | None = None
) -> Recipe:
    """Build a recipe from an already-parsed mapping (same schema as a file; imports resolve
    against the recipes roots)."""
    if not isinstance(data, Mapping):
        raise RecipeError(f"<{name}>: a recipe must be a mapping, got {type(data).__name__}")
    return _build(data, name=name, path=None, shown=f"<{name}>", overrides=overrides)


def parse_overrides(args: Iterable[str]) -> dict[str, Any]:
    """Turn command-line ``key=value`` strings into an overrides dict (values read as YAML)."""
    out: dict[str, Any] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key.strip():
            raise RecipeError(f"override {arg!r} is not of the form key=value")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise RecipeError(f"override {arg!r}: value is not valid YAML: {exc}") from exc
    return out
