"""Verdicts: what one engine does with a checkpoint, and the table ``modelopt-k3-check`` prints.

A refusal is any finding that stops the engine serving the export as calibrated; its ``verdict`` says how the user
meets it (the engine refuses, the server cannot start, it serves garbage without a word, the MTP drafter does not
load: ``checkpoint.serving_rules.SEVERITY``) and ``rule`` names the serving rule it breaks, when it has a name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field

from ..checkpoint.serving_rules import (  # noqa: F401 (the verdicts' one home; re-exported)
    CANNOT_START,
    DIFFERENT,
    GARBAGE,
    LOADS,
    NO_DRAFTER,
    NOT_VERIFIED,
    REFUSES,
    SEVERITY,
)


class EngineRefusal(ValueError):
    """A recipe (or export) that a named serving engine cannot serve; the message names layers and rules."""


@dataclass(frozen=True)
class Refusal:
    """The engine stops loading at ``tensor`` (or, with ``tensor`` a config file, before any tensor)."""

    tensor: str
    reason: str
    verdict: str = REFUSES  # how the user meets it (SEVERITY, above DIFFERENT)
    rule: str = ""  # the serving rule's name (checkpoint.serving_rules.RULES), when it has one


@dataclass(frozen=True)
class Deviation:
    """The engine loads ``module`` but computes with other numbers than the checkpoint's calibration.

    ``error``: the largest relative change the engine's reading makes (a weight element's, or a scale's).
    """

    module: str
    what: str
    error: float
    rule: str = ""


def _named(rule: str) -> str:
    return f"[{rule}] " if rule else ""


def _error(d: Deviation) -> str:
    if math.isnan(d.error):  # a named rule's deviation without a number is about files, not tensor values
        return "n/a (not a tensor's numbers)" if d.rule else "not computed (no tensor values read)"
    return f"{d.error:.3g}"


@dataclass
class EngineResult:
    engine: str
    refusals: list[Refusal] = field(default_factory=list)
    deviations: list[Deviation] = field(default_factory=list)
    # Flags the serve command needs for this export (each "flag: why"); they do not change the verdict.
    serve_flags: list[str] = field(default_factory=list)
    # What the engine warns about while loading (each "where: what"); they do not change the verdict either.
    warnings: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if self.refusals:
            return min((r.verdict for r in self.refusals), key=SEVERITY.index)
        return DIFFERENT if self.deviations else LOADS

    @property
    def ok(self) -> bool:
        return self.verdict == LOADS

    def headline(self) -> str:
        if self.refusals:
            first = next(r for r in self.refusals if r.verdict == self.verdict)
            more = f" (+{len(self.refusals) - 1} more)" if len(self.refusals) > 1 else ""
            return f"first failing: {_named(first.rule)}{first.tensor}: {first.reason}{more}"
        if self.deviations:
            known = [d for d in self.deviations if not math.isnan(d.error)]
            worst = max(known, key=lambda d: d.error) if known else self.deviations[0]
            modules = sorted({d.module for d in self.deviations})
            return (f"{len(modules)} module(s) differ, max relative error {_error(worst)} ({_named(worst.rule)}"
                    f"{worst.module}: {worst.what})")
        return ""

    def details(self, shown: int = 3, groups: int = 8) -> list[str]:
        """Refusals grouped by reason (a few tensors each), then the deviating modules."""
        by_reason: dict[tuple[str, str, str], list[str]] = {}
        for r in self.refusals:
            by_reason.setdefault((r.verdict, r.rule, r.reason), []).append(r.tensor)
        lines: list[str] = []
        for (verdict, rule, reason), tensors in list(by_reason.items())[:groups]:
            more = f" (+{len(tensors) - shown} more)" if len(tensors) > shown else ""
            lead = "refuses" if verdict == REFUSES else f"{verdict} --"
            lines.append(f"  {lead} {_named(rule)}{', '.join(tensors[:shown])}{more}:\n      {reason}")
        lines += [f"  {_named(d.rule)}{d.module}: {d.what} (relative error {_error(d)})"
                  for d in self.deviations[:groups * shown]]
        hidden = max(len(by_reason) - groups, 0) + max(len(self.deviations) - groups * shown, 0)
        if hidden:
            lines.append(f"  ... and {hidden} more")
        return lines



def not_verified(engine: str, reason: str):
    """The replay of an engine whose loader for a model was not read (or not run): every export gets "not
    verified" with ``reason`` (on ``config.json``), never a guessed "loads" or "refuses"."""

    def replay(layout, *, numerics: bool = True) -> EngineResult:
        result = EngineResult(engine)
        result.refusals.append(Refusal("config.json", reason, verdict=NOT_VERIFIED))
        return result

    replay.__qualname__ = f"not_verified[{engine}]"
    return replay

@dataclass
class CheckReport:
    """``check_export``'s answer: one result per named engine."""

    source: str
    results: dict[str, EngineResult]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results.values())

    def table(self, *, details: bool | Collection[str] = True) -> str:
        """The verdict per engine, then the details of each engine that does not load correctly (all of
        them, or only those named in ``details``)."""
        width = max(len(e) for e in self.results) if self.results else 6
        lines = [f"modelopt-k3-check {self.source}", f"  {'engine':<{width}}  verdict"]
        for name, result in self.results.items():
            head = result.headline()
            lines.append(f"  {name:<{width}}  {result.verdict}" + (f" -- {head}" if head else ""))
            lines += [f"  {'':<{width}}  serve with {flag}" for flag in result.serve_flags]
            lines += [f"  {'':<{width}}  warns: {w}" for w in _condensed(result.warnings)]
        if details:
            for name, result in self.results.items():
                if not result.ok and (details is True or name in details):
                    lines.append(f"{name}:")
                    lines += result.details()
        return "\n".join(lines)


WARNINGS_SHOWN_PER_RULE = 2


def _condensed(warnings: list[str]) -> list[str]:
    """The warnings in order, at most ``WARNINGS_SHOWN_PER_RULE`` of each ``[rule]`` and one line counting the rest:
    a recipe that sets every input scale the same way (e.g. ``nvfp4_act_headroom``'s headroom) trips one rule on
    every Linear, and a page of identical findings hides the other engines' verdicts."""
    shown: list[str] = []
    per_rule: dict[str, int] = {}
    for w in warnings:
        m = re.match(r"\[([\w-]+)\]", w)
        rule = m[1] if m else None
        per_rule[rule] = per_rule.get(rule, 0) + 1
        if rule is None or per_rule[rule] <= WARNINGS_SHOWN_PER_RULE:
            shown.append(w)
    shown += [f"[{rule}] ... and {n - WARNINGS_SHOWN_PER_RULE} more like these"
              for rule, n in per_rule.items() if rule is not None and n > WARNINGS_SHOWN_PER_RULE]
    return shown

