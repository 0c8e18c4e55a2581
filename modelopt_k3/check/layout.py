"""What a checkpoint holds, as a serving engine's loader sees it: names, dtypes, shapes, configs.

A ``Layout`` is built either from an export directory (``scan_export``: safetensors headers and the
two JSON configs; tensor bytes are read later, one small tensor at a time) or from a recipe and the
source checkpoint's names (``planned_layout``: what the export *would* hold, declared by the same
``modelopt_format`` functions the exporters write through). The engine replays in
``modelopt_k3.check.engines`` read only a ``Layout``, so the same rules judge a finished export and
a recipe before any weight is read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint import CheckpointError, CheckpointReader, read_json
from ..checkpoint.source_check import check_experts
from ..export.modelopt_format import config_quantization_config, hf_quant_config
from ..quant.decisions import DecisionTable, run_table
from ..quant.schemes import FP8, FP8_PB_WO, NVFP4, NVFP4_TENSOR, W4A16_NVFP4
from ..recipe import Recipe
from ..run.planning import read_source
from ..spec import get_spec

HF_QUANT_CONFIG = "hf_quant_config.json"
KV_SCALE_SUFFIXES = ("k_scale", "v_scale")
# Suffixes a quantized Linear may carry besides ``weight`` (ModelOpt and compressed-tensors MXFP4 names).
# weight_scale_inv: a block-FP8 source Linear (DeepSeek-V3's hub checkpoints): planned layouts read such sources.
# ``weight_shape``: a compressed-tensors pack-quantized INT4 source Linear (Kimi-K2.5's experts) stores it.
_LINEAR_PARTS = ("weight", "weight_packed", "weight_scale", "weight_scale_2", "input_scale", "bias", "weight_scale_inv",
                 "weight_shape")
_EMBEDDING_RE = re.compile(r"(^|\.)(embed_tokens|embed_in|tok_embeddings|word_embeddings|wte|wpe|embeddings)$")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class TensorMeta:
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} {list(self.shape)}"


@dataclass(frozen=True)
class Linear:
    """One checkpoint Linear (a dense module or one routed expert's projection) and its tensors."""

    name: str
    tensors: dict[str, TensorMeta]

    def tensor_name(self, part: str = "weight") -> str:
        return f"{self.name}.{part}"

    @property
    def fmt(self) -> str:
        """How it is stored: bf16, nvfp4, w4a16_nvfp4, fp8, fp8_pb, mxfp4, int4 (a pack-quantized source), or
        unknown."""
        t = self.tensors
        weight, scale = t.get("weight"), t.get("weight_scale")
        if "weight_packed" in t:
            if t["weight_packed"].dtype == torch.int32 and "weight_shape" in t:
                return "int4"
            return "mxfp4" if scale is not None and scale.dtype == torch.uint8 else "unknown"
        if weight is None:
            return "unknown"
        if weight.dtype == torch.uint8 and NVFP4_TENSOR.global_scale_key in t:
            return (NVFP4 if "input_scale" in t else W4A16_NVFP4).engine_method
        if weight.dtype == torch.float8_e4m3fn and scale is not None:
            # A 4-D scale is ModelOpt's block layout even when it holds one block (a Linear under 128x128).
            per_tensor = _numel(scale.shape) == 1 and len(scale.shape) != 4
            return (FP8 if per_tensor else FP8_PB_WO).engine_method
        if weight.dtype in _FLOAT_DTYPES and scale is None:
            return "bf16"
        return "unknown"

    @property
    def shape(self) -> tuple[int, int]:
        """Logical ``(out_features, in_features)``."""
        if "weight_packed" in self.tensors:
            out_f, words = self.tensors["weight_packed"].shape
            return out_f, words * (8 if self.tensors["weight_packed"].dtype == torch.int32 else 2)  # int4 | mxfp4
        out_f, cols = self.tensors["weight"].shape
        return out_f, cols * 2 if self.tensors["weight"].dtype == torch.uint8 else cols


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass
class Layout:
    """A checkpoint as names, dtypes and shapes, plus its configs (``quant`` None: not quantized)."""

    config: dict
    quant: dict | None  # config.json ``quantization_config``
    hf_quant: dict | None  # hf_quant_config.json
    linears: dict[str, Linear]
    kv_scales: dict[str, TensorMeta]
    tensors: dict[str, TensorMeta]
    # Reads one tensor's values (None for a planned layout: nothing is written yet).
    read: Callable[[str], torch.Tensor] | None = field(default=None, repr=False)
    source: str = ""
    # Modules stored in a quantized format that no engine builds as a quantizable Linear (a router, an
    # embedding, a norm): ``quantized_non_linears``.
    quantized_non_linears: tuple[str, ...] = ()

    @property
    def text_config(self) -> dict:
        text = self.config.get("text_config")
        return text if isinstance(text, dict) else self.config

    def value(self, name: str) -> torch.Tensor:
        if self.read is None:
            raise ValueError(f"{self.source} is a planned layout: tensor {name} has no values yet")
        return self.read(name)


def _group_linears(metas: dict[str, TensorMeta]) -> dict[str, Linear]:
    parts: dict[str, dict[str, TensorMeta]] = {}
    other: set[str] = set()
    for key, meta in metas.items():
        module, _, part = key.rpartition(".")
        if part in _LINEAR_PARTS:
            parts.setdefault(module, {})[part] = meta
        elif part not in KV_SCALE_SUFFIXES:
            other.add(module)
    out: dict[str, Linear] = {}
    for module, tensors in parts.items():
        weight = tensors.get("weight") or tensors.get("weight_packed")
        if weight is None or len(weight.shape) != 2 or _EMBEDDING_RE.search(module) or module in other:
            # Norms (1-D), convolutions (3-D), embeddings and routers (weight + e_score_correction_bias,
            # as convert/plan.py::_is_linear rules them out) are not Linears.
            continue
        out[module] = Linear(module, tensors)
    return out


_QUANT_PARTS = ("weight_packed", "weight_scale", "weight_scale_2", "input_scale")


def quantized_non_linears(metas: dict[str, TensorMeta], linears: dict[str, Linear]) -> tuple[str, ...]:
    """Modules with a quantization tensor (codes, a scale) or a uint8/FP8 ``weight`` that are not Linears
    (``_group_linears``: routers beside their ``e_score_correction_bias``, embeddings, norms, convolutions): an
    engine builds them as plain parameters and loads the raw codes into them."""
    found = set()
    for key, meta in metas.items():
        module, _, part = key.rpartition(".")
        if module in linears:
            continue
        if part in _QUANT_PARTS or (part == "weight" and meta.dtype in (torch.uint8, torch.float8_e4m3fn)):
            found.add(module)
    return tuple(sorted(found))


def _read_json(path: Path) -> dict | None:
    """A JSON object file of the export through the one validating reader (``checkpoint.read_json``: a regular
    file, bounded size, no duplicate keys, no NaN), or None when absent; anything else one ``CheckpointError``."""
    if not path.exists() and not path.is_symlink():
        return None
    data = read_json(path)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object (a {type(data).__name__})")
    for key in ("quantization_config", "quantization"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise CheckpointError(f"{path}: {key} is a {type(data[key]).__name__}, not a JSON object")
    return data


def scan_export(export_dir: str | Path) -> tuple[Layout, CheckpointReader]:
    """The layout of an export directory (headers only) and the reader its values come from.

    The caller owns the reader (a context manager): tensors are read one at a time, on demand.
    """
    path = Path(export_dir)
    config = _read_json(path / "config.json")
    if config is None:
        raise CheckpointError(f"{path} has no config.json")
    reader = CheckpointReader(path)
    metas = {k: TensorMeta(reader.info(k).dtype, reader.info(k).shape) for k in reader.names()}
    linears = _group_linears(metas)
    layout = Layout(
        config=config,
        quant=config.get("quantization_config"),
        hf_quant=_read_json(path / HF_QUANT_CONFIG),
        linears=linears,
        quantized_non_linears=quantized_non_linears(metas, linears),
        kv_scales={k: m for k, m in metas.items() if k.rpartition(".")[2] in KV_SCALE_SUFFIXES},
        tensors=metas,
        read=reader.get,
        source=str(path),
    )
    return layout, reader


def _planned_tensors(linear: Linear, fmt) -> dict[str, TensorMeta]:
    """The tensors the exporters write for ``linear`` in ``fmt`` (``Scheme.layout``)."""
    if fmt is None:
        if linear.fmt in ("mxfp4", "int4"):  # a routed expert left unquantized is decoded and written as BF16
            return {"weight": TensorMeta(torch.bfloat16, linear.shape)}
        if "weight_scale_inv" in linear.tensors:  # a kept block-FP8 source Linear is written decoded, BF16
            kept = {"weight": TensorMeta(torch.bfloat16, linear.tensors["weight"].shape)}
            return {**kept, **({"bias": linear.tensors["bias"]} if "bias" in linear.tensors else {})}
        return dict(linear.tensors)
    layout = fmt.scheme.layout(linear.shape)
    return {suffix: TensorMeta(dtype, shape) for suffix, dtype, shape in layout}


def _run_table(path: Path, config: dict, recipe: Recipe,
               reader: CheckpointReader | None) -> tuple[CheckpointReader, DecisionTable]:
    """The reader and decision table hf_ptq's preflight would have for ``recipe`` on this checkpoint: the spec's
    checkpoint view, the source check's carried modules, ``run_table`` (headers only: no file stays open)."""
    spec = get_spec(str(config.get("model_type", "")))
    if reader is None:
        reader, source = read_source(path, config, spec)
    else:
        source = check_experts(reader.headers(), config, spec, reader.stored_name)
    return reader, run_table(reader.inventory(), spec, recipe, source.carried)


def planned_layout(checkpoint: str | Path, recipe: Recipe, *, kv_scale_names: Iterable[str] = (),
                   reader: CheckpointReader | None = None, table: DecisionTable | None = None,
                   config: dict | None = None) -> Layout:
    """What exporting ``checkpoint`` with ``recipe`` writes, from names and headers only.

    The decision table (``quant.decisions.run_table``, which the exporters themselves follow) gives each
    module its format and the unquantized modules; tensors and configs are declared by the exporters'
    own functions. Shared-input groups change scale values, not names, so they are not needed here.
    ``kv_scale_names``: the KV-cache scale tensors the model's spec writes (when the recipe asks).
    ``reader`` (the source's, headers read), ``table`` (its decision table for ``recipe``) and ``config``
    (its config.json): a run's, already decided; else made by the preflight's own steps (``_run_table``).
    """
    path = Path(checkpoint)
    config = _read_json(path / "config.json") if config is None else config
    if config is None:
        raise CheckpointError(f"{path} has no config.json")
    if table is None:  # a library call: the table a run's preflight would decide, by the same steps
        reader, table = _run_table(path, config, recipe, reader)
    elif table.recipe is not recipe:
        raise ValueError(f"the decision table is for recipe {table.recipe.name}, not {recipe.name}")
    metas = {k: TensorMeta(reader.info(k).dtype, reader.info(k).shape) for k in reader.names()}
    source = _group_linears(metas)
    linears: dict[str, Linear] = {}
    for d in table.decisions.values():
        if d.kind not in ("linear", "experts"):
            continue
        for name in d.module_names():
            linears[name] = Linear(name, _planned_tensors(source[name], d.format))
    kv = {name: TensorMeta(torch.float32, ()) for name in kv_scale_names} if recipe.kv_cache else {}
    quant = hf = None
    layer_algos = table.layer_algos()
    if layer_algos:
        hf = hf_quant_config(layer_algos, kv_cache=recipe.kv_cache, unquantized=table.unquantized_modules(),
                             recipe=recipe.name, naming=table.naming)
        quant = config_quantization_config(hf)
    tensors = {f"{n}.{p}": m for n, lin in linears.items() for p, m in lin.tensors.items()}
    return Layout(config=config, quant=quant, hf_quant=hf, linears=linears, kv_scales=kv,
                  tensors={**tensors, **kv}, source=f"{path} with recipe {recipe.name}")
