"""The ModelOpt Hugging Face checkpoint format (``quant_method: "modelopt"``), tensor by tensor.

Pure functions: given a weight and its scales, the exact tensors FORMATS.md prescribes; given what was
quantized, ``hf_quant_config.json`` and the ``quantization_config`` for ``config.json``. Both the model
exporter and the calibration-free streaming converter write through these.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping

import torch

from .. import __version__
from ..numerics import fp8 as fp8n
from ..numerics import nvfp4 as nvn
from ..numerics.constants import FP8_BLOCK, NVFP4_BLOCK

WEIGHT_ALGOS = ("NVFP4", "W4A16_NVFP4", "FP8", "FP8_PB_WO")
# The layout this module writes is nvidia-modelopt 0.47.0's; engines check the producer's name.
MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.47.0"}


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
    """128x128 block FP8; ``weight_scale`` in ModelOpt's shape ``[ceil(out/128), 1, ceil(in/128), 1]``
    (the amax of its block quantizer keeps the reduced dims: nvidia-modelopt 0.47.0
    ``TensorQuantizer._setup_for_blockquant`` reshapes to ``[R, 128, C, 128]``; vLLM's
    ``ModelOptFp8PbWoLinearMethod`` allocates exactly this shape)."""
    w, s = fp8n.fp8_quantize_blockwise(weight, block=FP8_BLOCK)
    return {"weight": w, "weight_scale": s.to(torch.float32)[:, None, :, None].contiguous()}


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
            ("weight_scale", torch.float8_e4m3fn, (out_f, in_f // NVFP4_BLOCK)),
            ("weight_scale_2", torch.float32, ()),
        ]
    elif weights == "fp8":
        layout = [("weight", torch.float8_e4m3fn, (out_f, in_f)), ("weight_scale", torch.float32, ())]
    elif weights == "fp8_pb":
        blocks = (-(-out_f // FP8_BLOCK), 1, -(-in_f // FP8_BLOCK), 1)  # partial edge blocks
        layout = [("weight", torch.float8_e4m3fn, (out_f, in_f)), ("weight_scale", torch.float32, blocks)]
    else:
        raise ValueError(f"unknown weight format {weights!r}")
    if input_scale:
        layout.append(("input_scale", torch.float32, ()))
    return layout


def input_scale_tensor(scale: torch.Tensor) -> torch.Tensor:
    return scale.detach().reshape(()).to(torch.float32).cpu()


def layer_entry(algo: str) -> dict:
    """One ``quantized_layers`` entry as ModelOpt 0.47 writes it (``process_layer_quant_config``).

    ``FP8_PB_WO`` is written upper-case, as ModelOpt's own Kimi-K3 converter writes it
    (NVIDIA/Model-Optimizer c985838ebceeeb75dad62a4fa1dc60301ca80f4d,
    ``examples/kimi/kimi_k3/quantize_to_nvfp4.py`` ``_build_hf_quant_config``); ModelOpt's generic
    export writes the format's internal name ``fp8_pb_wo``, which vLLM upper-cases anyway.
    """
    if algo in ("NVFP4", "W4A16_NVFP4"):
        return {"quant_algo": algo, "group_size": NVFP4_BLOCK}
    return {"quant_algo": algo}


def summarize_exclusions(unquantized: Iterable[str], quantized: Iterable[str]) -> list[str]:
    """ModelOpt's ``exclude_modules``: each unquantized module as its shortest dotted prefix wildcard
    that matches no quantized module (nvidia-modelopt 0.47.0 ``quant_utils.py``
    ``_prefix_wildcard_summarize_exclude_modules``): ``a.b*`` when nothing quantized starts with ``a.b``,
    else ``a.b.*`` when nothing quantized is ``a.b`` or starts with ``a.b.``, else deeper, else the name.
    """
    names = sorted(set(quantized))
    exact = set(names)

    def starts(prefix: str) -> bool:  # does a quantized name start with ``prefix``?
        i = bisect.bisect_left(names, prefix)
        return i < len(names) and names[i].startswith(prefix)

    out: set[str] = set()
    for name in unquantized:
        choice = name
        for i, char in enumerate(name):
            if char != ".":
                continue
            head = name[:i]
            if not starts(head):
                choice = head + "*"
                break
            if head not in exact and not starts(head + "."):
                choice = head + ".*"
                break
        out.add(choice)
    return sorted(out)


def hf_quant_config(
    layer_algos: Mapping[str, str], *, kv_cache: str | None, unquantized: Iterable[str], recipe: str | None = None
) -> dict:
    """``hf_quant_config.json`` with exactly ModelOpt 0.47's fields (``get_quant_config``).

    One format: ``quant_algo``, ``kv_cache_quant_algo``, its ``group_size`` and the summarized
    ``exclude_modules``; more: ``MIXED_PRECISION`` and ``quantized_layers`` (ModelOpt writes no
    ``exclude_modules`` then). ``producer`` names the layout (engines' fallback parsers check its
    name); this tool's identity goes in ``modelopt_k3``, a key no engine reads.
    """
    algos = sorted(set(layer_algos.values()))
    quant: dict = {"quant_algo": None, "kv_cache_quant_algo": kv_cache.upper() if kv_cache else None}
    if len(algos) == 1:
        quant.update(layer_entry(algos[0]))
        quant["exclude_modules"] = summarize_exclusions(unquantized, layer_algos)
    else:
        quant["quant_algo"] = "MIXED_PRECISION" if algos else None
        quant["quantized_layers"] = {name: layer_entry(algo) for name, algo in sorted(layer_algos.items())}
    ours = {"name": "modelopt_k3", "version": __version__}
    if recipe:
        ours["recipe"] = recipe
    return {"producer": dict(MODELOPT_PRODUCER), "quantization": quant, "modelopt_k3": ours}


def _group_args(entry: dict) -> dict:
    """A ``config_groups`` entry (ModelOpt ``convert_hf_config.py`` ``_quant_algo_to_group_config``)."""
    algo, size = entry["quant_algo"], entry.get("group_size")
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": size or NVFP4_BLOCK}
    fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    if algo == "NVFP4":
        return {"input_activations": dict(fp4), "weights": fp4}
    if algo == "W4A16_NVFP4":
        return {"weights": fp4}
    if algo == "FP8":
        return {"input_activations": dict(fp8), "weights": fp8}
    return {"quant_algo": algo}  # ModelOpt has no compressed-tensors spelling for FP8_PB_WO


def config_quantization_config(hf_quant: dict) -> dict:
    """``config.json``'s ``quantization_config``: ModelOpt 0.47's ``convert_hf_quant_config_format``.

    ``quant_method`` is ``modelopt_mixed`` for ``MIXED_PRECISION``, as ModelOpt's own Kimi-K3
    converter writes it (``_rewrite_config_json``, commit above): SGLang picks its mixed-precision
    config by that name; vLLM accepts both.
    """
    q = hf_quant["quantization"]
    algo = q["quant_algo"]
    out: dict = {}
    if algo == "MIXED_PRECISION":
        by_entry: dict[tuple, list[str]] = {}
        for name, entry in q["quantized_layers"].items():
            by_entry.setdefault(tuple(sorted(entry.items())), []).append(name)
        out["config_groups"] = {
            f"group_{i}": {**_group_args(dict(key)), "targets": sorted(names)} for i, (key, names) in enumerate(by_entry.items())
        }
        out["quantized_layers"] = q["quantized_layers"]
    elif algo in ("NVFP4", "W4A16_NVFP4", "FP8"):
        out["config_groups"] = {"group_0": {**_group_args(q), "targets": ["Linear"]}}
    out["ignore"] = q.get("exclude_modules", [])
    if algo:
        out["quant_algo"] = algo
    if q.get("kv_cache_quant_algo") == "FP8":
        out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    out["producer"] = hf_quant["producer"]
    out["quant_method"] = "modelopt_mixed" if algo == "MIXED_PRECISION" else "modelopt"
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
