"""``recipe.algorithm``: the calibration algorithm a recipe names, held as written (nvidia-modelopt 0.47 spellings).

A recipe writes ``algorithm: max`` or a mapping ``{method: ..., <options>}`` as ModelOpt's recipes do
(``modelopt_recipes/configs/ptq/presets/model/*.yaml``). This layer checks the syntax only (a method name,
scalar options, the ``layerwise`` block); what each method's options are, their types and defaults, is the
algorithm's typed config, registered with its handler in ``modelopt_k3.quant.calibrators``
(``algorithm_config``), which refuses unknown methods and options, not ignores them. The recipe layer sits
below the calibrators, so it cannot hold that list itself (docs/decisions/0002-calibrator-registry.md).

Four-over-six: ModelOpt states it as ``{method: mse, fp8_scale_sweep: false, start_multiplier: 1.0,
stop_multiplier: 1.5, step_size: 0.5}`` plus ``four_over_six: true`` on the weight quantizer's
``block_sizes``. Our recipes name exported formats, not quantizer attributes (the export is plain
NVFP4), so ``four_over_six: true`` is an option of the ``mse`` method here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# ``layerwise: {...}``, any method (ModelOpt 0.47's ``LayerwiseConfig``): option -> type. ``save_every`` and
# ``calib_mutates_weights`` are ModelOpt's too, refused by name (every layer is checkpointed here).
LAYERWISE_OPTIONS: dict[str, type] = {"enable": bool, "get_qdq_activations_from_prev_layer": bool,
                                      "checkpoint_dir": str}
_SCALARS = (bool, int, float, str)


class AlgorithmError(ValueError):
    """An ``algorithm`` value a recipe cannot have; the message names the method/option and the choices."""


@dataclass(frozen=True)
class Layerwise:
    """``algorithm.layerwise``: calibrate one decoder layer at a time (``modelopt_k3.layerwise``).

    ``qdq_inputs`` None: the method's default (``get_qdq_activations_from_prev_layer``: each layer's inputs
    come from the quantized layers before it, GPTQ; else the unquantized model's, so max equals a resident run;
    ``quant.calibrators.qdq_inputs`` decides).
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
    """A recipe's ``algorithm``: the method and the options the recipe set, as written (sorted by name;
    ``quant.calibrators.algorithm_config`` types them and fills the defaults). Compares equal to its method
    name when it sets no options."""

    method: str
    options: tuple[tuple[str, Any], ...] = ()
    layerwise: Layerwise = Layerwise()

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
    """A recipe's ``algorithm`` value (a method name or a ``{method: ..., ...}`` mapping) -> ``Algorithm``
    (syntax: the method a name, each option a scalar; the registry checks the rest)."""
    if isinstance(value, Algorithm):
        return value
    if isinstance(value, str):
        value = {"method": value}
    if not isinstance(value, Mapping) or not isinstance(value.get("method"), str):
        raise AlgorithmError(f"algorithm {value!r} must be a method name or a mapping with a 'method' key")
    method = value["method"].lower()
    options = []
    for key, v in value.items():
        if key in ("method", "layerwise"):
            continue
        if not isinstance(key, str) or not isinstance(v, _SCALARS):
            raise AlgorithmError(f"algorithm {method} option {key!r} must be a name with a scalar value, got {v!r}")
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
