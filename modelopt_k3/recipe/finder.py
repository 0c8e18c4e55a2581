"""Where recipe files are: the recipes roots, name -> file resolution, and how a file is named in messages.

The roots are resolved once per load (``RecipeRoots.current()``) and passed to every lookup of that
load, so a recipe and all its imports see one consistent search path.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .model import RecipeError

YAML_SUFFIXES = (".yaml", ".yml")
# The package directory: the repository's top-level recipes/ sits next to it in a source checkout (or
# editable install); a wheel carries them inside it as modelopt_k3/recipes.
_PACKAGE_DIR = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class RecipeRoots:
    """The directories searched for recipe names, in order."""

    dirs: tuple[Path, ...]

    @classmethod
    def current(cls) -> RecipeRoots:
        """$MODELOPT_K3_RECIPES entries first, then the built-in directory (a packaged copy inside the
        package wins over the repository's top-level one)."""
        roots: list[Path] = []
        for part in os.environ.get("MODELOPT_K3_RECIPES", "").split(os.pathsep):
            if part.strip():
                roots.append(Path(part.strip()).expanduser().resolve())
        for candidate in (_PACKAGE_DIR / "recipes", _PACKAGE_DIR.parent / "recipes"):
            if candidate.is_dir():
                roots.append(candidate)
        return cls(tuple(dict.fromkeys(roots)))

    def presets(self) -> list[str]:
        names: set[str] = set()
        for root in self.dirs:
            presets = root / "presets"
            if presets.is_dir():
                names.update(p.stem for p in presets.iterdir() if p.suffix in YAML_SUFFIXES)
        return sorted(names)

    def display(self, path: Path) -> str:
        """How a file is named in messages: 'recipes/presets/nvfp4.yaml' for files under a root."""
        for root in self.dirs:
            try:
                return f"{root.name}/{path.relative_to(root).as_posix()}"
            except ValueError:
                continue
        return str(path)

    def name_of(self, path: Path) -> str:
        """A recipe's name: its path under the first root holding it, without suffix (else its stem)."""
        for root in self.dirs:
            try:
                return path.relative_to(root).with_suffix("").as_posix()
            except ValueError:
                continue
        return path.stem

    def find_recipe(self, name_or_path: str | Path) -> Path:
        """A recipe file by path, or by name under a root (as-is, then under presets/)."""
        direct = Path(name_or_path).expanduser()
        if direct.is_file():
            return direct.resolve()
        name = str(name_or_path)
        for root in self.dirs:
            for base in (root, root / "presets"):
                found = _first_file(_candidates(base, name))
                if found is not None:
                    return found
        raise RecipeError(
            f"recipe {name!r} not found: not a file, and not under any recipes root "
            f"({', '.join(str(r) for r in self.dirs) or 'none'}) as-is or under presets/. "
            f"Available presets: {', '.join(self.presets()) or 'none'}"
        )

    def find_import(self, spec: str, importer: Path | None, where: str) -> Path:
        """An imported file: absolute as it is, ``./``-relative to the importer, else under a root, then
        relative to the importer."""
        raw = Path(spec).expanduser()
        here = importer.parent if importer is not None else None
        if raw.is_absolute():
            bases = [Path("/")]
        elif spec.startswith("."):
            bases = [here] if here is not None else [Path.cwd()]
        else:
            bases = [*self.dirs, *([here] if here is not None else [])]
        tried = [c for b in bases for c in _candidates(b, spec)]
        found = _first_file(tried)
        if found is None:
            raise RecipeError(f"{where}: import {spec!r} not found; tried: {', '.join(str(t) for t in tried)}")
        return found


def recipes_roots() -> list[Path]:
    """Directories searched for recipe names: $MODELOPT_K3_RECIPES entries first, then the built-in one."""
    return list(RecipeRoots.current().dirs)


def available_presets() -> list[str]:
    return RecipeRoots.current().presets()


def _candidates(base: Path, name: str) -> list[Path]:
    path = base / name
    out = [path]
    if path.suffix not in YAML_SUFFIXES:
        out += [path.with_name(path.name + s) for s in YAML_SUFFIXES]
    return out


def _first_file(paths: Iterable[Path]) -> Path | None:
    for p in paths:
        if p.is_file():
            return p.resolve()
    return None
