"""Export formats: one object per on-disk checkpoint layout a quantized model can be written in.

The quantization formats (NVFP4, FP8, ...) are ``modelopt_k3.quant.schemes``; this registry is the other
axis, the file layout: how one quantized Linear's tensors are named, whether a recipe can be expressed
at all, and which config files describe it. The CLI and ``export_checkpoint`` resolve the name here
once (``export_format``) and hand the object on; nothing else compares export-format names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from ..quant.schemes import KvCacheFormat
from ..recipe import Recipe
from ..spec import ManifestNaming
from . import compressed_tensors_format as ct_format
from .format_names import EXPORT_FORMAT_NAMES, ExportFormatName
from .modelopt_format import config_quantization_config, hf_quant_config


@dataclass(frozen=True, repr=False)
class ExportFormat:
    """An export layout. ``engine_checked``: ``modelopt-k3-check`` replays the engines' loaders of it."""

    name: str
    engine_checked: bool

    def __repr__(self) -> str:
        return repr(self.name)

    def __str__(self) -> str:
        return self.name

    def rename_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One quantized Linear's ModelOpt-named tensors, as this layout stores them."""
        raise NotImplementedError

    def unexpressible(self, algos: set[str], kv_cache: KvCacheFormat | None) -> str | None:
        """Why this layout cannot hold a model quantized with ``algos`` (and ``kv_cache``), or None."""
        raise NotImplementedError

    def configs(
        self, layer_algos: Mapping[str, str], unquantized: Iterable[str], recipe: Recipe,
        naming: ManifestNaming | None = None,
    ) -> tuple[dict, dict | None]:
        """``config.json``'s ``quantization_config`` and ``hf_quant_config.json`` (None: not written);
        ``naming``: how the model's engines spell its modules in a manifest (the spec's)."""
        raise NotImplementedError


class _ModelOptFormat(ExportFormat):
    def rename_tensors(self, tensors):
        return tensors

    def unexpressible(self, algos, kv_cache):
        return None  # per-layer entries (MIXED_PRECISION) and KV scales: ModelOpt's layout holds any recipe

    def configs(self, layer_algos, unquantized, recipe, naming=None):
        hf_quant = hf_quant_config(layer_algos, kv_cache=recipe.kv_cache, unquantized=unquantized, recipe=recipe.name,
                                   naming=naming)
        return config_quantization_config(hf_quant), hf_quant


class _CompressedTensorsFormat(ExportFormat):
    def rename_tensors(self, tensors):
        return ct_format.rename_tensors(tensors)

    def unexpressible(self, algos, kv_cache):
        return ct_format.unexpressible(algos, kv_cache)

    def configs(self, layer_algos, unquantized, recipe, naming=None):
        return ct_format.quantization_config(next(iter(layer_algos.values())), list(unquantized)), None


MODELOPT = _ModelOptFormat(ExportFormatName.MODELOPT.value, engine_checked=True)
COMPRESSED_TENSORS = _CompressedTensorsFormat(ExportFormatName.COMPRESSED_TENSORS.value, engine_checked=False)
EXPORT_FORMATS: dict[str, ExportFormat] = {f.name: f for f in (MODELOPT, COMPRESSED_TENSORS)}
if tuple(EXPORT_FORMATS) != EXPORT_FORMAT_NAMES:  # the CLI's choices are these names: one registry
    raise AssertionError(f"export formats {list(EXPORT_FORMATS)} != their names {list(EXPORT_FORMAT_NAMES)}")


def export_format(fmt: str | ExportFormat) -> ExportFormat:
    """The registered export format ``fmt`` names (an ``ExportFormat`` passes through)."""
    if isinstance(fmt, ExportFormat):
        return fmt
    try:
        return EXPORT_FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown export format {fmt!r}; supported: {list(EXPORT_FORMATS)}") from None
