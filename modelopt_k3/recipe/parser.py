"""Recipe files -> ``Recipe``: safe YAML, every key and value validated, imports spliced in place.

Errors are ``RecipeError`` naming the file (as it sits under its recipes root), the entry and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..quant.schemes import TensorFormat, format_for_ct_args, kv_cache_format, tensor_format
from .algorithm import AlgorithmError, parse_algorithm
from .finder import RecipeRoots
from .model import (
    DISABLED,
    INPUT_FORMATS,
    KV_CACHE_FORMATS,
    WEIGHT_FORMATS,
    QuantFormat,
    Recipe,
    RecipeEntry,
    RecipeError,
)

_RECIPE_KEYS = ("description", "imports", "algorithm", "kv_cache", "calibrate_all_experts", "quant_cfg")
_UNIT_KEYS = ("description", "imports", "quant_cfg")
_OVERRIDE_KEYS = ("name", "algorithm", "kv_cache", "calibrate_all_experts", "quant_cfg", "allow_unmatched")
MAX_RECIPE_BYTES = 1 << 20
# Imports nest at most this deep: a recipe is a few units, and a deeper chain is a mistake or a trap.
MAX_IMPORT_DEPTH = 16
_ENTRY_KEYS = (
    "pattern", "enable", "weights", "inputs", "input_amax", "scheme", "must_match", "reason",
)
_FORMAT_KEYS = ("weights", "inputs", "input_amax", "scheme")


# --------------------------------------------------------------------------- public entry points


def load_recipe(name_or_path: str | Path, *, overrides: Mapping[str, Any] | None = None) -> Recipe:
    """Load a recipe by file path, or by name under a recipes root (as-is, then under presets/).

    ``overrides`` takes the recipe keys ``algorithm``, ``kv_cache``, ``calibrate_all_experts``
    and ``name`` (replacing the file's), ``quant_cfg`` (appended, so its entries win) and
    ``allow_unmatched`` (a pattern that matches no module is then not refused).

    Imports resolve only inside the recipes roots, and inside the directory of a recipe file given
    by path outside them (its own units): an import that resolves elsewhere is refused before it is
    read, and no error quotes a file's content.
    """
    roots = RecipeRoots.current()
    path = roots.find_recipe(name_or_path)
    inside_roots = any(path.is_relative_to(r) for r in roots.dirs)
    parser = _Parser(roots, roots.dirs if inside_roots else (*roots.dirs, path.parent))
    data = parser.read_yaml(path, ())
    return parser.build(data, name=parser.roots.name_of(path), path=path, overrides=overrides)


def recipe_from_dict(
    data: Mapping[str, Any], *, name: str = "inline", overrides: Mapping[str, Any] | None = None
) -> Recipe:
    """Build a recipe from an already-parsed mapping (same schema as a file; imports resolve
    against the recipes roots)."""
    if not isinstance(data, Mapping):
        raise RecipeError(f"<{name}>: a recipe must be a mapping, got {type(data).__name__}")
    roots = RecipeRoots.current()
    return _Parser(roots, roots.dirs).build(data, name=name, path=None, overrides=overrides)


# --------------------------------------------------------------------------- files and imports


@dataclass(frozen=True)
class _Parser:
    """One load: the recipes roots it resolves names against (found once, shared by every import), and
    each imported unit's entries, parsed once (a unit imported along many paths, a diamond, costs one
    parse: without it, ``n`` levels of diamonds parse the bottom unit ``2**n`` times)."""

    roots: RecipeRoots
    confine: tuple[Path, ...]  # every import must resolve inside one of these
    _units: dict[Path, list[RecipeEntry]] = field(default_factory=dict)

    def read_yaml(self, path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
        shown = self.roots.display(path)
        try:
            size = path.stat().st_size
            if not path.is_file() or size > MAX_RECIPE_BYTES:
                raise RecipeError(f"{shown}: not a recipe file (a regular file of at most {MAX_RECIPE_BYTES} bytes)")
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise RecipeError(f"{shown}: not valid (safe) YAML: not UTF-8 text") from None
        except OSError as exc:
            raise RecipeError(f"{shown}: cannot read: {exc.strerror or exc}") from None
        try:
            # safe_load only: recipe files are data; tags such as !!python/object are refused.
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            via = f" (imported via {' -> '.join(self.roots.display(p) for p in chain)})" if chain else ""
            raise RecipeError(f"{shown}{via}: not valid (safe) YAML: {_yaml_problem(exc)}") from None
        if data is None:
            raise RecipeError(f"{shown}: the file is empty")
        if not isinstance(data, dict):
            raise RecipeError(f"{shown}: the top level must be a mapping, got {type(data).__name__}")
        return data

    def build(
        self, data: Mapping[str, Any], *, name: str, path: Path | None, overrides: Mapping[str, Any] | None
    ) -> Recipe:
        shown = self.roots.display(path) if path is not None else f"<{name}>"
        _check_keys(data, _RECIPE_KEYS, shown, "a recipe")
        settings = _settings(data, shown)
        entries = self.file_entries(data, shown, path, (path,) if path is not None else ())
        if overrides:
            if not isinstance(overrides, Mapping):
                raise RecipeError(f"overrides must be a mapping, got {type(overrides).__name__}")
            _check_keys(overrides, _OVERRIDE_KEYS, "overrides", "recipe overrides")
            settings.update(_settings(overrides, "overrides"))
            if "name" in overrides:
                name = _want(overrides["name"], str, "overrides", "name", "a string")
            # Override entries are appended, so they win over the file's.
            entries += self.quant_cfg(overrides.get("quant_cfg"), "overrides", None, ())
        if not entries:
            raise RecipeError(f"{shown}: the recipe has no quant_cfg entries")
        return Recipe(name=name, path=path, entries=tuple(entries), **settings)

    def file_entries(
        self, data: Mapping[str, Any], shown: str, path: Path | None, chain: tuple[Path, ...]
    ) -> list[RecipeEntry]:
        """A file's entries: its top-level ``imports`` first, then ``quant_cfg`` (with imports in place)."""
        entries: list[RecipeEntry] = []
        imports = data.get("imports")
        if imports is not None:
            if isinstance(imports, str):
                imports = [imports]
            if not isinstance(imports, list):
                raise RecipeError(f"{shown}: imports must be a list of paths, got {type(imports).__name__}")
            for i, spec in enumerate(imports):
                entries += self.import_entries(spec, f"{shown}: imports[{i}]", path, chain)
        entries += self.quant_cfg(data.get("quant_cfg"), shown, path, chain)
        return _last_of_each(entries)

    def quant_cfg(self, items: Any, where: str, importer: Path | None, chain: tuple[Path, ...]) -> list[RecipeEntry]:
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
                out += self.import_entries(item["import"], here, importer, chain)
            else:
                out.append(_parse_entry(item, here))
        return out

    def import_entries(self, spec: Any, where: str, importer: Path | None, chain: tuple[Path, ...]) -> list[RecipeEntry]:
        """The entries of an imported unit, tagged with where they were imported."""
        spec = _want(spec, str, where, "import", "a recipe path")
        path = self.roots.find_import(spec, importer, where)
        if not any(path.is_relative_to(r.resolve()) for r in self.confine):
            raise RecipeError(f"{where}: import {spec!r} resolves to {path}, outside the recipes roots "
                              f"({', '.join(str(r) for r in self.confine)}); imports stay inside them")
        if path in chain:
            cycle = " -> ".join(self.roots.display(p) for p in (*chain, path))
            raise RecipeError(f"{where}: circular import: {cycle}")
        if len(chain) >= MAX_IMPORT_DEPTH:
            raise RecipeError(f"{where}: imports nest deeper than {MAX_IMPORT_DEPTH} levels "
                              f"({' -> '.join(self.roots.display(p) for p in chain[:3])} -> ...)")
        if path not in self._units:
            data = self.read_yaml(path, chain)
            shown = self.roots.display(path)
            _check_keys(data, _UNIT_KEYS, shown, "an imported unit (a unit holds only quant_cfg and imports)")
            self._units[path] = self.file_entries(data, shown, path, (*chain, path))
        entries = self._units[path]
        # Tag imported entries with who imported them, so errors trace back to the recipe.
        return [
            RecipeEntry(e.pattern, e.format, e.reason, e.must_match, f"{e.source} (imported at {where})")
            for e in entries
        ]


# --------------------------------------------------------------------------- keys and values


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where, without the snippet of the file that PyYAML quotes."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or type(exc).__name__
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def _last_of_each(entries: list[RecipeEntry]) -> list[RecipeEntry]:
    """Drop an entry that an identical one (pattern, format, flags) follows: the last matching entry wins,
    so an earlier copy never decides anything; a unit imported along many paths then counts once."""
    seen: set[tuple] = set()
    out: list[RecipeEntry] = []
    for e in reversed(entries):
        key = (e.pattern, e.format, e.reason, e.must_match)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out[::-1]


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


def _format_name(value: Any, allowed: tuple[str, ...], where: str, key: str, nullable: bool) -> TensorFormat | None:
    """The registry format a recipe names (resolved here, once)."""
    if value is None and nullable:
        return None
    expect = " | ".join(allowed) + (" | null" if nullable else "")
    if not isinstance(value, str) or value.lower() not in allowed:
        raise RecipeError(f"{where}: {key}: unknown format {value!r}; expected {expect}")
    return tensor_format(value.lower(), role=key)


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

    def kind(args: Any, role: str) -> TensorFormat | None:
        if args is None:
            return None
        fmt = format_for_ct_args(args, role)
        if fmt is not None:
            return fmt
        strategy = getattr(args.strategy, "value", args.strategy)
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
    return RecipeEntry(pattern, _entry_format(item, where_p), reason, must_match, where)


def _entry_format(item: Mapping[str, Any], where_p: str) -> QuantFormat:
    """An enabled entry's format: ``scheme`` or ``weights``/``inputs``, plus ``input_amax``."""
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
        return QuantFormat(weights, inputs, amax)
    except ValueError as exc:
        raise RecipeError(f"{where_p}: {exc}") from exc


def _settings(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "algorithm" in data:
        try:
            out["algorithm"] = parse_algorithm(data["algorithm"])
        except AlgorithmError as exc:
            raise RecipeError(f"{where}: {exc}") from None
    if "kv_cache" in data:
        kv = data["kv_cache"]
        if isinstance(kv, str) and kv.lower() == "none":
            kv = None
        if kv is not None and (not isinstance(kv, str) or kv.lower() not in KV_CACHE_FORMATS):
            raise RecipeError(f"{where}: kv_cache {kv!r} is not supported; expected null or one of "
                              f"{list(KV_CACHE_FORMATS)}")
        out["kv_cache"] = kv_cache_format(kv) if kv is not None else None
    if "calibrate_all_experts" in data:
        out["calibrate_all_experts"] = _want(
            data["calibrate_all_experts"], bool, where, "calibrate_all_experts", "true or false"
        )
    if data.get("description") is not None:
        out["description"] = _want(data["description"], str, where, "description", "a string")
    if "allow_unmatched" in data and where == "overrides":  # a run's choice (--allow_unmatched), never a file's
        out["allow_unmatched"] = _want(data["allow_unmatched"], bool, where, "allow_unmatched", "true or false")
    return out


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
