"""The ModelOpt Hugging Face checkpoint format (``quant_method: "modelopt"``), tensor by tensor.

Pure functions: given a weight and its scales, the exact tensors FORMATS.md prescribes; given what was
quantized, ``hf_quant_config.json`` and the ``quantization_config`` for ``config.json``. Both the model
exporter and the calibration-free streaming converter write through these.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .. import __version__
from ..numerics import fp8 as fp8n
from ..numerics import nvfp4 as nvn

NVFP4_GROUP = 16
FP8_BLOCK = 128
WEIGHT_ALGOS = ("NVFP4", "W4A16_NVFP4", "FP8", "FP8_PB_WO")


def nvfp4_weight_tensors(weight: torch.Tensor, weight_scale_2: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight`` (packed E2M1), ``weight_scale`` (E4M3 per 16), ``weight_scale_2`` (fp32 [])."""
    q = nvn.nvfp4_quantize(weight, weight_scale_2)
    return {
        "weight": q.packed,
        "weight_scale": q.block_scale,
        "weight_scale_2": q.global_scale.reshape(()).to(torch.float32),
    }


def fp8_weight_tensors(weight: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    w, s = fp8n.fp8_quantize_per_tensor(weight, scale)
    return {"weight": w, "weight_scale": s.reshape(()).to(torch.float32)}


def fp8_pb_weight_tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    w, s = fp8n.fp8_quantize_blockwise(weight, block=FP8_BLOCK)
    return {"weight": w, "weight_scale": s.to(torch.float32)}


def weight_tensors(fmt: str, weight: torch.Tensor, scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    if fmt == "nvfp4":
        return nvfp4_weight_tensors(weight, scale)
    if fmt == "fp8":
        return fp8_weight_tensors(weight, scale)
    if fmt == "fp8_pb":
        return fp8_pb_weight_tensors(weight)
    raise ValueError(f"unknown weight format {fmt!r}")


def linear_layout(
    weights: str, shape: tuple[int, int], *, input_scale: bool
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(suffix, dtype, shape)`` of every tensor one quantized Linear ``[out, in]`` is written as.

    What ``weight_tensors`` (plus ``input_scale``) produces, known before any value is computed:
    the streaming converter writes shard headers from it.
    """
    out_f, in_f = shape
    if weights == "nvfp4":
        layout = [
            ("weight", torch.uint8, (out_f, in_f // 2)),
            ("weight_scale", torch.float8_e4m3fn, (out_f, in_f // NVFP4_GROUP)),
            ("weight_scale_2", torch.float32, ()),
        ]
    elif weights == "fp8":
        layout = [("weight", torch.float8_e4m3fn, (out_f, in_f)), ("weight_scale", torch.float32, ())]
    elif weights == "fp8_pb":
        blocks = (-(-out_f // FP8_BLOCK), -(-in_f // FP8_BLOCK))  # partial edge blocks
        layout = [("weight", torch.float8_e4m3fn, (out_f, in_f)), ("weight_scale", torch.float32, blocks)]
    else:
        raise ValueError(f"unknown weight format {weights!r}")
    if input_scale:
        layout.append(("input_scale", torch.float32, ()))
    return layout


def input_scale_tensor(scale: torch.Tensor) -> torch.Tensor:
    return scale.detach().reshape(()).to(torch.float32).cpu()


def layer_entry(algo: str) -> dict:
    if algo in ("NVFP4", "W4A16_NVFP4"):
        return {"quant_algo": algo, "group_size": NVFP4_GROUP}
    if algo == "FP8_PB_WO":
        return {"quant_algo": algo, "block_size": [FP8_BLOCK, FP8_BLOCK]}
    return {"quant_algo": algo}


def hf_quant_config(
    layer_algos: Mapping[str, str], *, kv_cache: str | None, exclude_modules: list[str], recipe: str | None = None
) -> dict:
    """``hf_quant_config.json``: one ``quant_algo``, or ``MIXED_PRECISION`` with ``quantized_layers``."""
    algos = sorted(set(layer_algos.values()))
    quant: dict = {"kv_cache_quant_algo": kv_cache.upper() if kv_cache else None, "exclude_modules": exclude_modules}
    if len(algos) == 1:
        quant = {"quant_algo": algos[0], **layer_entry(algos[0]), **quant}
    else:
        quant = {
            "quant_algo": "MIXED_PRECISION",
            **quant,
            "quantized_layers": {name: layer_entry(algo) for name, algo in sorted(layer_algos.items())},
        }
    producer = {"name": "modelopt_k3", "version": __version__}
    if recipe:
        producer["recipe"] = recipe
    return {"producer": producer, "quantization": quant}


def _group_args(algo: str) -> dict:
    if algo in ("NVFP4", "W4A16_NVFP4"):
        weights = {"num_bits": 4, "type": "float", "group_size": NVFP4_GROUP}
        inputs = dict(weights) if algo == "NVFP4" else None
    elif algo == "FP8":
        weights = {"num_bits": 8, "type": "float"}
        inputs = dict(weights)
    else:  # FP8_PB_WO
        weights = {"num_bits": 8, "type": "float", "block_structure": [FP8_BLOCK, FP8_BLOCK]}
        inputs = None
    return {"weights": weights, "input_activations": inputs, "targets": ["Linear"]}


def config_quantization_config(hf_quant: dict) -> dict:
    """The ``quantization_config`` entry of ``config.json`` carrying the same facts."""
    q = hf_quant["quantization"]
    kv = q.get("kv_cache_quant_algo")
    out = {
        "quant_method": "modelopt",
        "producer": hf_quant["producer"],
        "quant_algo": q["quant_algo"],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": False} if kv else None,
        "ignore": q["exclude_modules"],
    }
    if q["quant_algo"] == "MIXED_PRECISION":
        out["quantized_layers"] = q["quantized_layers"]
        algos = sorted({v["quant_algo"] for v in q["quantized_layers"].values()})
        out["config_groups"] = {f"group_{i}": _group_args(a) for i, a in enumerate(algos)}
    else:
        out["config_groups"] = {"group_0": _group_args(q["quant_algo"])}
        if "group_size" in q:
            out["group_size"] = q["group_size"]
    return out


def strip_source_quantization(config: dict) -> dict:
    """A copy of ``config.json`` without the source checkpoint's (compressed-tensors) scheme."""
    config = dict(config)
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        text = dict(config["text_config"])
        text.pop("quantization_config", None)
        config["text_config"] = text
    return config
