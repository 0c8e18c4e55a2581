"""What the transformers-native stand-in tests share: the checkpoint transformers' model is given when the source
is quantized (INT4 pack-quantized experts decoded by compressed-tensors' own compressor, block-FP8 weights by
transformers' own dequantize), and the checkpoint's stored tensor names."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def stored(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[key] = f.get_tensor(key)
    return out


def stored_names(ckpt: Path) -> list[str]:
    return list(json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"])


def dequantized_copy(ckpt: Path, dst: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """``ckpt`` unchanged when unquantized; else a copy with every quantized weight decoded to ``dtype`` (BF16 by
    default) by the format's own library and quantization_config dropped (what transformers' CPU model is given)."""
    config = json.loads((ckpt / "config.json").read_text())
    qcfg = config.pop("quantization_config", None)
    if qcfg is None:
        return ckpt
    config.get("text_config", {}).pop("quantization_config", None)  # Kimi-K2.5 repeats it there
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    tensors = stored(ckpt)
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors[key + "_scale_inv"]
            out[key] = _dequantize_fp8_weight(t, scale, qcfg["weight_block_size"], torch.float32).to(dtype)
        elif key.endswith(".weight_packed"):
            head = key.removesuffix(".weight_packed")
            w = qcfg["config_groups"]["group_0"]["weights"]
            scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**{
                k: w[k] for k in ("num_bits", "type", "strategy", "group_size", "symmetric")}))
            state = {n: tensors[f"{head}.{n}"] for n in ("weight_packed", "weight_scale", "weight_shape")}
            out[f"{head}.weight"] = PackedQuantizationCompressor.decompress(state, scheme)["weight"].to(dtype)
        elif not key.endswith(("_scale_inv", ".weight_scale", ".weight_shape")):
            out[key] = t
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst
