"""The calibrator contract and its registry: one typed config and one handler per algorithm, registered once.

A recipe's ``algorithm:`` block is held by the recipe as written (``recipe.algorithm.Algorithm``: the method
and its options, syntax only; the recipe layer sits below this one and cannot know the algorithms). Here each
algorithm is a frozen ``AlgorithmConfig`` subclass (its options as typed fields with ModelOpt's defaults, and
its properties as class attributes) plus a ``Calibrator`` subclass, the handler, whose ``config_type`` names
the config; ``register_calibrator`` records the pair once, keyed by config type (torchao's ``quantize_`` looks
a handler up by config type; ModelOpt's calibrate modes carry their config class the same way).

Every consumer asks the registry, not a list of its own: the recipe's options (``algorithm_config``), the
handler (``calibrator_for``), the layerwise default (``qdq_inputs``), the report's ``weight_algorithm``
names (``weight_algorithm_names``), the planner's per-weight state (``AlgorithmConfig.state_bytes``) and the
``--qformat`` presets (``qformat_presets``). Adding an algorithm is one file here and its name on the package's
import line (docs/decisions/0002-calibrator-registry.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from ...recipe.algorithm import Algorithm, AlgorithmError, parse_algorithm

ForwardLoop = Callable[[nn.Module], None]
# MXFP4-sourced experts (the source's own scales, carried by the exact cast) and block-FP8 Linears written as
# their source bytes (quant/block_fp8_source.py): what max records whatever the algorithm (weights.max_algorithm).
LOSSLESS_CAST = "lossless_cast"
_OPTION_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


@dataclass(frozen=True)
class AlgorithmConfig:
    """One algorithm's options (subclasses: typed fields, ModelOpt 0.47's defaults) and properties.

    Class attributes, read through the registry:

    - ``method``: the recipe's ``method:``, spelled as ModelOpt spells it;
    - ``weight_algorithms``: what its handler records as a weight's ``weight_algorithm`` (the report's field)
      where it set the scales; empty for an algorithm that leaves weights to max;
    - ``qdq_inputs_by_default``: under layerwise, whether each layer's inputs come from the quantized layers
      before it (ModelOpt's ``get_qdq_activations_from_prev_layer`` default) unless the recipe says;
    - ``presets``: ``--qformat nvfp4_<name>`` -> the ``algorithm:`` options of that preset (its recipe files,
      ``<base>_<name>.yaml``, are data; a test checks they say this).

    ``check`` refuses option combinations the handler cannot run (raise ``AlgorithmError``).
    """

    method: ClassVar[str]
    weight_algorithms: ClassVar[tuple[str, ...]] = ()
    qdq_inputs_by_default: ClassVar[bool] = False
    presets: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

    def check(self) -> None:
        """Refuse option combinations (ranges are the handler's to state; nothing by default)."""

    def state_bytes(self, out_features: int, in_features: int, dtype_bytes: int) -> tuple[int, int]:
        """(input sums held while calibrating, state kept until the export), in bytes, for one NVFP4 weight
        ``[out, in]`` (one local expert's projection for experts); the memory planner sums them. None: (0, 0)."""
        return 0, 0

    @classmethod
    def options(cls) -> dict[str, tuple[type, Any]]:
        """Option -> (type, default), from the fields."""
        return {f.name: (_OPTION_TYPES[f.type] if isinstance(f.type, str) else f.type, f.default)
                for f in dataclasses.fields(cls)}

    @classmethod
    def from_algorithm(cls, algorithm: Algorithm) -> AlgorithmConfig:
        """The typed config of a recipe's ``algorithm`` (its options checked against the fields)."""
        spec = cls.options()
        values = {}
        for key, v in algorithm.options:
            if key not in spec:
                raise AlgorithmError(f"algorithm {cls.method} has no option {key!r}; its options: "
                                     f"{[*spec, 'layerwise']}")
            typ = spec[key][0]
            if typ is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, typ) or (typ is not bool and isinstance(v, bool)):
                raise AlgorithmError(f"algorithm {cls.method} option {key} must be {typ.__name__}, got {v!r}")
            values[key] = v
        config = cls(**values)
        config.check()
        return config


class Calibrator:
    """One calibration algorithm's handler. ``calibrate`` runs observe -> reduce -> finalize; subclasses
    override the steps. ``config``: its typed options; ``algorithm``: the recipe's spelling (the labels'
    text). ``labels``: quantizer name -> what chose its scales, in words (the summary's lines);
    ``weight_algorithms``: weight quantizer name -> which of ``weight_algorithm_names()`` produced its scales
    (the report's ``weight_algorithm``), filled by max's finalize and overwritten where a search ran.
    ``rewritten``: source tensors (norm and router weights) whose value in the model the calibration changed
    (``awq``'s fold): the export writes the model's value, in the source dtype, where it would copy the source.
    ``load``: the run's load when the whole model is calibrated (see ``__init__``)."""

    config_type: ClassVar[type[AlgorithmConfig]]

    def __init__(self, algorithm: Algorithm, config: AlgorithmConfig) -> None:
        if type(config) is not self.config_type:
            raise ValueError(f"{type(self).__name__} takes {self.config_type.__name__}, not {type(config).__name__}")
        self.algorithm = algorithm
        self.config = config
        self.labels: dict[str, str] = {}
        self.weight_algorithms: dict[str, str] = {}
        self.rewritten: set[str] = set()
        # The run's load (``quant.api.LoadFacts``: spec, placement, source reader) when the scope calibrated is
        # the whole loaded model (``calibrate_scope`` sets it); None for a part of it (a layerwise layer) or a
        # bare module. Handlers read the run from here, never off the model.
        self.load = None

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


# config type -> handler, and method -> config type (the recipe names a method), in registration order
CALIBRATORS: dict[type[AlgorithmConfig], type[Calibrator]] = {}
CONFIGS: dict[str, type[AlgorithmConfig]] = {}


def register_calibrator(cls: type[Calibrator]) -> type[Calibrator]:
    """Class decorator: registers the handler under its ``config_type``, once, and the config's method."""
    config = cls.__dict__.get("config_type")
    if config is None or not (isinstance(config, type) and issubclass(config, AlgorithmConfig)):
        raise TypeError(f"{cls.__name__} names no config_type of its own (an AlgorithmConfig subclass)")
    if config in CALIBRATORS or config.method in CONFIGS:
        raise ValueError(f"algorithm {config.method!r} is already registered "
                         f"({CALIBRATORS.get(config, CALIBRATORS.get(CONFIGS.get(config.method)))})")
    taken = {p for c in CONFIGS.values() for p in c.presets} & set(config.presets)
    if taken:
        raise ValueError(f"algorithm {config.method!r}: preset(s) {sorted(taken)} already belong to another algorithm")
    CALIBRATORS[config] = cls
    CONFIGS[config.method] = config
    return cls


def algorithm_config(algorithm: Algorithm | str | Mapping[str, Any]) -> AlgorithmConfig:
    """The typed config of a recipe's ``algorithm`` (an ``Algorithm``, a method name or a mapping)."""
    algorithm = parse_algorithm(algorithm)
    config = CONFIGS.get(algorithm.method)
    if config is None:
        raise AlgorithmError(f"algorithm {algorithm.method!r} is not supported; expected one of {list(CONFIGS)}")
    return config.from_algorithm(algorithm)


def calibrator_for(algorithm: Algorithm | str | Mapping[str, Any]) -> Calibrator:
    """A fresh handler for ``algorithm``, looked up by its config's type."""
    algorithm = parse_algorithm(algorithm)
    config = algorithm_config(algorithm)
    return CALIBRATORS[type(config)](algorithm, config)


def qdq_inputs(algorithm: Algorithm) -> bool:
    """Whether a layerwise run feeds each layer the quantized outputs of the layers before it: the recipe's
    ``layerwise.get_qdq_activations_from_prev_layer``, else the algorithm's default."""
    chosen = algorithm.layerwise.qdq_inputs
    return type(algorithm_config(algorithm)).qdq_inputs_by_default if chosen is None else chosen


def weight_algorithm_names() -> tuple[str, ...]:
    """Every value a report's ``weight_algorithm`` can take: max, each algorithm's, the lossless cast."""
    names = ["max"]
    for config in CONFIGS.values():
        names += [n for n in config.weight_algorithms if n not in names]
    return (*names, LOSSLESS_CAST)


def qformat_presets() -> dict[str, tuple[str, Algorithm]]:
    """``--qformat`` name -> (preset name, its ``algorithm:``) of every registered algorithm's presets;
    ``nvfp4_<preset>`` is NVFP4's modules with that algorithm (run/plan.py names the recipe)."""
    return {f"nvfp4_{name}": (name, parse_algorithm({"method": config.method, **options}))
            for config in CONFIGS.values() for name, options in config.presets.items()}
