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
    "gptq": {
        "perc_damp": (float, 0.01),
        "block_size": (int, 128),
        # Ours, not ModelOpt's (default False: its one Hessian forward): update each layer's weights in
        # stages, later stages' Hessians from the earlier stages' quantized outputs (quant/calibrators/gptq.py).
        "true_sequential": (bool, False),
        # Ours too (needs true_sequential): a later stage's GPTQ aims at the unquantized model's output of the
        # Linear, ||W X - Ŵ X̃||, not at ||W X̃ - Ŵ X̃|| (X̃: its inputs with the earlier stages quantized).
        "asymmetric": (bool, False),
    },
}
# ``layerwise: {...}``, any method (ModelOpt 0.47's ``LayerwiseConfig``): option -> type. ``save_every`` and
# ``calib_mutates_weights`` are ModelOpt's too, refused by name (every layer is checkpointed here).
LAYERWISE_OPTIONS: dict[str, type] = {"enable": bool, "get_qdq_activations_from_prev_layer": bool,
                                      "checkpoint_dir": str}
# Methods whose scales depend on the inputs quantized layers give (ModelOpt defaults
# ``get_qdq_activations_from_prev_layer`` to True for GPTQ only).
QDQ_INPUTS_BY_DEFAULT = frozenset({"gptq"})


class AlgorithmError(ValueError):
    """An ``algorithm`` value a recipe cannot have; the message names the method/option and the choices."""


@dataclass(frozen=True)
class Layerwise:
    """``algorithm.layerwise``: calibrate one decoder layer at a time (``modelopt_k3.layerwise``).

    ``qdq_inputs`` None: the method's default (``get_qdq_activations_from_prev_layer``: each layer's inputs
    come from the quantized layers before it, GPTQ; else the unquantized model's, so max equals a resident run).
    """

    enable: bool = False
    qdq_inputs: bool | None = None
    checkpoint_dir: str | None = None

    def to_recipe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"enable": self.enable}
        if self.qdq_inputs is not None:
            out["get_qdq_activations_from_prev_layer"] = self.qdq_inputs
        if self.checkpoint_dir is not None:
            out["checkpoint_dir"] = self.checkpoint_dir
        return out


@dataclass(frozen=True)
class Algorithm:
    """A parsed ``recipe.algorithm``: the method and the options the recipe set (ModelOpt's defaults
    fill the rest through ``get``). Compares equal to its method name when it sets no options."""

    method: str
    options: tuple[tuple[str, Any], ...] = ()
    layerwise: Layerwise = Layerwise()

    def qdq_inputs(self) -> bool:
        """Whether a layerwise run feeds each layer the quantized outputs of the layers before it."""
        chosen = self.layerwise.qdq_inputs
        return self.method in QDQ_INPUTS_BY_DEFAULT if chosen is None else chosen

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
            return not self.options and self.layerwise == Layerwise() and other == self.method
        if isinstance(other, Algorithm):
            return (self.method, self.options, self.layerwise) == (other.method, other.options, other.layerwise)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.method, self.options, self.layerwise))

    def to_recipe(self) -> str | dict[str, Any]:
        """The recipe spelling (``max``, or ``{method: ..., options}``), as ``parse_algorithm`` reads it."""
        if not self.options and self.layerwise == Layerwise():
            return self.method
        out: dict[str, Any] = {"method": self.method, **dict(self.options)}
        if self.layerwise != Layerwise():
            out["layerwise"] = self.layerwise.to_recipe()
        return out


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
        if key in ("method", "layerwise"):
            continue
        if key not in spec:
            raise AlgorithmError(f"algorithm {method} has no option {key!r}; its options: "
                                 f"{[*spec, 'layerwise']}")
        typ = spec[key][0]
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, typ) or (typ is not bool and isinstance(v, bool)):
            raise AlgorithmError(f"algorithm {method} option {key} must be {typ.__name__}, got {v!r}")
        options.append((key, v))
    return Algorithm(method, tuple(sorted(options)), _parse_layerwise(value.get("layerwise"), method))


def _parse_layerwise(value: Any, method: str) -> Layerwise:
    """``layerwise: {enable, get_qdq_activations_from_prev_layer, checkpoint_dir}`` (a bool is ``enable``)."""
    if value is None:
        return Layerwise()
    if isinstance(value, bool):
        value = {"enable": value}
    if not isinstance(value, Mapping):
        raise AlgorithmError(f"algorithm {method} option layerwise must be a mapping, got {value!r}")
    unknown = sorted(set(value) - set(LAYERWISE_OPTIONS))
    if unknown:
        raise AlgorithmError(f"algorithm {method} layerwise has no option {unknown[0]!r} here; its options: "
                             f"{list(LAYERWISE_OPTIONS)} (every layer is checkpointed)")
    for key, typ in LAYERWISE_OPTIONS.items():
        v = value.get(key)
        if v is not None and not isinstance(v, typ):
            raise AlgorithmError(f"algorithm {method} layerwise.{key} must be {typ.__name__}, got {v!r}")
    enable = bool(value.get("enable", False))
    if value.get("checkpoint_dir") is not None and not enable:
        raise AlgorithmError(f"algorithm {method}: layerwise.checkpoint_dir needs layerwise.enable: true")
    return Layerwise(enable, value.get("get_qdq_activations_from_prev_layer"), value.get("checkpoint_dir"))
