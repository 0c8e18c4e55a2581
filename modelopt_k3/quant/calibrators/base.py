"""The calibrator contract and its registry (keyed by ``Algorithm.method``, recipe/algorithm.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from torch import nn

from ...recipe.algorithm import METHODS, Algorithm, parse_algorithm

ForwardLoop = Callable[[nn.Module], None]


class Calibrator:
    """One calibration algorithm. ``calibrate`` runs observe -> reduce -> finalize; subclasses
    override the steps. ``labels``: quantizer name -> what chose its scales, in words (the summary's lines);
    ``weight_algorithms``: weight quantizer name -> which of ``weights.WEIGHT_ALGORITHMS`` produced its scales
    (the report's ``weight_algorithm``), filled by max's finalize and overwritten where a search ran."""

    method: ClassVar[str]

    def __init__(self, algorithm: Algorithm) -> None:
        if algorithm.method != self.method:
            raise ValueError(f"{type(self).__name__} calibrates {self.method}, not {algorithm.method}")
        self.algorithm = algorithm
        self.labels: dict[str, str] = {}
        self.weight_algorithms: dict[str, str] = {}

    def observe(self, model: nn.Module, forward_loop: ForwardLoop | None) -> None:
        raise NotImplementedError

    def reduce(self, model: nn.Module) -> None:
        raise NotImplementedError

    def finalize(self, model: nn.Module, groups: dict[str, tuple[str, ...]]) -> None:
        raise NotImplementedError

    def calibrate(self, model: nn.Module, forward_loop: ForwardLoop | None,
                  groups: dict[str, tuple[str, ...]]) -> None:
        self.observe(model, forward_loop)
        self.reduce(model)
        self.finalize(model, groups)


CALIBRATORS: dict[str, type[Calibrator]] = {}


def register_calibrator(cls: type[Calibrator]) -> type[Calibrator]:
    """Class decorator; a method registers once and must be a ``recipe.algorithm`` method."""
    if cls.method in CALIBRATORS:
        raise ValueError(f"calibrator {cls.method!r} is already registered ({CALIBRATORS[cls.method].__name__})")
    if cls.method not in METHODS:
        raise ValueError(f"calibrator {cls.method!r} is not a recipe algorithm method ({list(METHODS)})")
    CALIBRATORS[cls.method] = cls
    return cls


def calibrator_for(algorithm: Algorithm | str) -> Calibrator:
    """A fresh calibrator for ``algorithm`` (a recipe's ``Algorithm`` or its spelling)."""
    algorithm = parse_algorithm(algorithm)
    cls = CALIBRATORS.get(algorithm.method)
    if cls is None:
        raise ValueError(f"no calibrator is registered for algorithm {algorithm.method!r}; registered: {list(CALIBRATORS)}")
    return cls(algorithm)
