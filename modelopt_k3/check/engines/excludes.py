"""An export's exclude list indexed once, so each module's question costs O(its name), not O(entries).

The engines' matching rules (vLLM's exact / substring / fnmatch, SGLang's module-path and regex rules,
TensorRT-LLM's fnmatchcase on a name and its ancestors) each loop over every entry per module: on a
manifest with 10^6 entries the check ran for minutes. The answers only ever ask which entries a module's
name (or a piece of it) equals, contains or is contained in, so a set of the entries, the lengths they
come in and one joined text answer them exactly; only entries with wildcard characters are matched one
by one (a manifest has few of those).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from fnmatch import fnmatch, fnmatchcase, translate
from functools import cached_property

__all__ = ["ExcludeIndex"]

_FNMATCH_SPECIAL = frozenset("*?[")
# Characters that make SGLang's ``pattern.replace(".", r"\.").replace("*", ".*")`` more than an equality.
_REGEX_SPECIAL = frozenset("*?[]()+{}|^$\\")


class ExcludeIndex:
    """The entries of one exclude list (in their order), with the lookups the engine rules need."""

    # Below this many entries a plain loop of C-level ``in`` checks beats slicing the name's windows (a real
    # manifest: ~200 entries, 2x faster looped); above it the windows win by orders of magnitude.
    LOOP_BELOW = 512

    def __init__(self, entries: Iterable[str]) -> None:
        self.entries: tuple[str, ...] = tuple(entries)
        self._set = frozenset(self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)

    def __contains__(self, name: object) -> bool:
        """``name`` is an entry (list membership)."""
        return name in self._set

    # ----------------------------------------------------------------- derived indexes, built on first use

    @cached_property
    def _lengths(self) -> tuple[int, ...]:
        return tuple(sorted({len(e) for e in self._set}))

    @cached_property
    def _fn_wild(self) -> tuple[str, ...]:
        return tuple(e for e in self.entries if _FNMATCH_SPECIAL & set(e))

    @cached_property
    def _fn_literal(self) -> frozenset[str]:
        return self._set.difference(self._fn_wild)

    @cached_property
    def _re_wild(self) -> tuple[str, ...]:
        return tuple(e for e in self.entries if _REGEX_SPECIAL & set(e))

    @cached_property
    def _re_globs(self) -> tuple[re.Pattern, ...]:
        """The wildcard entries as SGLang turns them into regexes, compiled once (every module asks)."""
        return tuple(re.compile(e.replace(".", r"\.").replace("*", ".*")) for e in self._re_wild)

    @cached_property
    def _re_literal(self) -> frozenset[str]:
        return self._set.difference(self._re_wild)

    @cached_property
    def _experts_text(self) -> str:
        # NUL never occurs in a module name: ``name in text`` is "name is inside one of these entries".
        return "\0".join(e for e in self.entries if "experts" in e)

    @cached_property
    def _module_paths(self) -> frozenset[str]:
        return frozenset(e.rstrip(".") for e in self._set)

    @cached_property
    def tails(self) -> frozenset[str]:
        """The last dotted part of every entry."""
        return frozenset(e.rsplit(".", 1)[-1] for e in self._set)

    # ----------------------------------------------------------------- the questions

    def has_substring_of(self, name: str, *, except_equal_to: str | None = None) -> bool:
        """Some entry (other than ``except_equal_to``) is a substring of ``name``."""
        if len(self.entries) < self.LOOP_BELOW:
            return any(e != except_equal_to and e in name for e in self.entries)
        n = len(name)
        for length in self._lengths:
            if length > n:
                break
            for start in range(n - length + 1):
                piece = name[start:start + length]
                if piece in self._set and piece != except_equal_to:
                    return True
        return False

    def inside_an_experts_entry(self, name: str) -> bool:
        """``name`` is a substring of some entry that names ``experts``."""
        return "\0" not in name and name in self._experts_text

    @cached_property
    def _fn_wild_regex(self) -> re.Pattern | None:
        """Every wildcard entry as one alternation of ``fnmatch.translate``'s regexes (what ``fnmatchcase``
        matches with, one entry at a time): one regex match per name instead of one per entry (the
        converter's closing check asked ~10^5 of these on a 64-expert stand-in)."""
        if not self._fn_wild:
            return None
        return re.compile("|".join(f"(?:{translate(e)})" for e in self._fn_wild))

    def fnmatch_any(self, name: str, *, case: bool = False) -> bool:
        """``fnmatch`` (``fnmatchcase`` with ``case``) of ``name`` against some entry."""
        if name in self._fn_literal:  # an entry without wildcards matches only itself
            return True
        if not case and os.path.normcase("A") != "A":  # fnmatch folds case here (Windows): entry by entry
            return any(fnmatch(name, e) for e in self._fn_wild)
        regex = self._fn_wild_regex  # fnmatch is fnmatchcase where normcase is the identity (POSIX)
        return regex is not None and regex.match(name) is not None

    @cached_property
    def full_regexes(self) -> tuple[re.Pattern, ...]:
        """The ``re:`` entries as compiled regexes (TensorRT-LLM's ``QuantConfig`` ``re.fullmatch``es them); an
        entry that does not compile is left out."""
        out = []
        for e in self.entries:
            if e.startswith("re:"):
                try:
                    out.append(re.compile(e[3:]))
                except re.error:
                    continue
        return tuple(out)

    @cached_property
    def subtree_parents(self) -> tuple[str, ...]:
        """``x`` of every ``x.*`` entry (TensorRT-LLM's ``QuantConfig``: a subtree wildcard also matches its root)."""
        return tuple(e[:-2] for e in self.entries if e.endswith(".*"))

    def first_fnmatchcase(self, name: str) -> str | None:
        """The first entry, in list order, that ``fnmatchcase`` matches ``name`` against."""
        hits = [e for e in self._fn_wild if fnmatchcase(name, e)]
        if name in self._fn_literal:
            hits.append(name)
        return min(hits, key=self.entries.index) if hits else None

    def module_path_match(self, prefix: str) -> bool:
        """Some entry (trailing dots dropped) is a run of whole dotted parts of ``prefix``: SGLang's
        ``ignored == prefix or prefix.startswith(ignored + ".") or f".{ignored}." in f".{prefix}."``."""
        parts = prefix.rstrip(".").split(".")
        paths = self._module_paths
        return any(".".join(parts[i:j]) in paths for i in range(len(parts)) for j in range(i + 1, len(parts) + 1))

    def regex_fullmatch_any(self, names: Iterable[str]) -> bool:
        """SGLang's glob (``.`` literal, ``*`` any run) of some entry matches one of ``names`` whole."""
        names = list(names)
        if any(n in self._re_literal for n in names):  # an entry with no special character matches only itself
            return True
        return any(regex.fullmatch(n) for regex in self._re_globs for n in names)
