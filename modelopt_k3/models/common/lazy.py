"""Classes a spec names but needs only when a model is built, imported then.

A transformers modeling module imports ``transformers.integrations.moe`` and ``transformers.masking_utils`` and
with them ``torch._dynamo`` (~1 s); the command lines that never build a model (convert, check, plan) read a
spec's regexes, recipes and rules only, so a spec holds such a class as a ``ClassRef``: the class, or a function
that imports and returns it (``modeling_class``), resolved (``resolve_class``) where a model is built. A package's
public names defined on those classes are its module's ``lazy_attrs``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

ClassRef = type | Callable[[], type]


def imported_attr(module: str, name: str) -> Callable[[], Any]:
    """``name`` of ``module`` (an absolute module path), imported when the returned function is called."""

    def load() -> Any:
        return getattr(importlib.import_module(module), name)

    load.__qualname__ = f"imported_attr[{module}.{name}]"
    return load


def modeling_class(model: str, name: str) -> Callable[[], type]:
    """``transformers.models.{model}.modeling_{model}.{name}``, imported when the returned function is called."""
    return imported_attr(f"transformers.models.{model}.modeling_{model}", name)


def resolve_class(ref: ClassRef) -> type:
    """The class ``ref`` holds, or the one its function returns."""
    return ref if isinstance(ref, type) else ref()


def lazy_attrs(module: str, attrs: Mapping[str, Callable[[], Any]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` giving each of ``attrs`` on first use (then kept on the module)."""

    def __getattr__(name: str) -> Any:
        if name not in attrs:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = attrs[name]()
        setattr(sys.modules[module], name, value)
        return value

    return __getattr__


__all__ = ["ClassRef", "imported_attr", "lazy_attrs", "modeling_class", "resolve_class"]
