"""``recipe.algorithm``: the calibration algorithm, in nvidia-modelopt 0.47's spellings, validated once.

A recipe writes ``algorithm: max`` or a mapping ``{method: ..., <options>}`` as ModelOpt's recipes do
(``modelopt_recipes/configs/ptq/presets/model/*.yaml``). ``METHODS`` lists each method's options with
their types and ModelOpt's defaults; ``modelopt_k3.quant.calibrators`` registers one calibrator per
method (a test checks the two agree). Unknown methods and options are refused, not ignored.

Four-over-six: ModelOpt states it as ``{method: mse, fp8_scale_sweep: false, start_multiplier: 1.0,
stop_multiplier: 1.5, step_size: 0.5}`` plus ``four_over_six: true`` on the weight quantizer's
``block_sizes``. Our recipes name exported formats, not quantizer attributes (the export is plain
NVFP4), so ``four_over_six: true`` is an option of the ``mse`` method here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# method -> option -> (type, ModelOpt 0.47 default)
METHODS: dict[str, dict[str, tuple[type, Any]]] = {
    "max": {},
    "mse": {
        "fp8_scale_sweep": (bool, False),
        "step_size": (float, 0.1),
        "start_multiplier": (float, 0.25),
        "stop_multiplier": (float, 4.0),
        "four_over_six": (bool, False),
    },
    "local_hessian": {
        "fp8_scale_sweep": (bool, True),
        "step_size": (float, 0.1),
        "start_multiplier": (float, 0.25),
        "stop_multiplier": (float, 4.0),
        "block_size": (int, 16),
    },
    # ``layerwise: {enable: ...}`` is ModelOpt's spelling; only ``enable: false`` runs (no layerwise engine yet).
    "gptq": {
        "perc_damp": (float, 0.01),
        "block_size": (int, 128),
        "layerwise": (bool, False),
    },
}


class AlgorithmError(ValueError):
    """An ``algorithm`` value a recipe cannot have; the message names the method/option and the choices."""


@dataclass(frozen=True)
class Algorithm:
    """A parsed ``recipe.algorithm``: the method and the options the recipe set (ModelOpt's defaults
    fill the rest through ``get``). Compares equal to its method name when it sets no options."""

    method: str
    options: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str) -> Any:
        spec = METHODS[self.method]
        if key not in spec:
            raise KeyError(f"algorithm {self.method} has no option {key!r}")
        return dict(self.options).get(key, spec[key][1])

    def __str__(self) -> str:
        if not self.options:
            return self.method
        return f"{self.method}(" + ", ".join(f"{k}={v}" for k, v in self.options) + ")"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return not self.options and other == self.method
        if isinstance(other, Algorithm):
            return (self.method, self.options) == (other.method, other.options)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.method, self.options))

    def to_recipe(self) -> str | dict[str, Any]:
        """The recipe spelling (``max``, or ``{method: ..., options}``), as ``parse_algorithm`` reads it."""
        if not self.options:
            return self.method
        return {"method": self.method,
                **{k: ({"enable": v} if k == "layerwise" else v) for k, v in self.options}}


MAX = Algorithm("max")


def parse_algorithm(value: Any) -> Algorithm:
    """A recipe's ``algorithm`` value (a method name or a ``{method: ..., ...}`` mapping) -> ``Algorithm``."""
    if isinstance(value, Algorithm):
        return value
    if isinstance(value, str):
        value = {"method": value}
    if not isinstance(value, Mapping) or not isinstance(value.get("method"), str):
        raise AlgorithmError(f"algorithm {value!r} must be a method name or a mapping with a 'method' key")
    method = value["method"].lower()
    if method not in METHODS:
        raise AlgorithmError(f"algorithm {value['method']!r} is not supported; expected one of {list(METHODS)}")
    spec = METHODS[method]
    options = []
    for key, v in value.items():
        if key == "method":
            continue
        if key not in spec:
            raise AlgorithmError(f"algorithm {method} has no option {key!r}; its options: {list(spec) or 'none'}")
        typ = spec[key][0]
        if key == "layerwise":
            v = _layerwise_enable(v, method)
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, typ) or (typ is not bool and isinstance(v, bool)):
            raise AlgorithmError(f"algorithm {method} option {key} must be {typ.__name__}, got {v!r}")
        options.append((key, v))
    return Algorithm(method, tuple(sorted(options)))


def _layerwise_enable(value: Any, method: str) -> bool:
    if not isinstance(value, Mapping) or set(value) != {"enable"} or not isinstance(value["enable"], bool):
        raise AlgorithmError(f"algorithm {method} option layerwise must be {{enable: true|false}}, got {value!r}")
    return value["enable"]
