"""Independent reference loader for tiny stand-in checkpoints (and the real remote code on them).

It shares nothing with the project's own loader: the model class comes from the checkpoint's
remote code through transformers' dynamic-module machinery, the model is built for real on the CPU
(so non-persistent buffers hold what the modules' own ``__init__`` computes), the MXFP4 experts are
decoded with compressed-tensors' own decompressor, and every persistent tensor is filled straight from
the safetensors files. The only project code it uses is what makes the remote code import and construct
here at all: the fla-core CPU path and the transformers compatibility shims (``models/kimi_k3/shims.py``),
neither of which changes what the model computes. Tests compare the project's loader against this baseline.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

_PACKED_SUFFIXES = (".weight_packed", ".weight_scale")


def load_reference_class(path: str | Path, auto_class: str = "AutoModelForCausalLM") -> tuple[Any, type]:
    """(config, model class without our MoE patch) for a checkpoint dir, via its own remote code."""
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from modelopt_k3.models.kimi_k3.shims import apply_class_shims, apply_import_shims

    apply_import_shims(path)
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=True)
    cls = get_class_from_dynamic_module(config.auto_map[auto_class], str(path))
    apply_class_shims(cls)
    return config, cls


def _mxfp4_scheme(config: Any) -> Any:
    from compressed_tensors.quantization import QuantizationConfig

    qcfg = getattr(config, "quantization_config", None)
    if qcfg is None:
        raise ValueError("checkpoint config has no top-level quantization_config")
    if not isinstance(qcfg, dict):
        qcfg = qcfg.to_dict()
    parsed = QuantizationConfig.model_validate(qcfg)
    if parsed.format != "mxfp4-pack-quantized" or len(parsed.config_groups) != 1:
        raise ValueError(f"expected one mxfp4-pack-quantized config group, got {qcfg}")
    return next(iter(parsed.config_groups.values()))


def _decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor, scheme: Any) -> torch.Tensor:
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor

    out = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, scheme)
    return out["weight"]


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a sharded checkpoint, as stored (index order)."""
    path = Path(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    by_file: dict[str, list[str]] = defaultdict(list)
    for key, fname in index["weight_map"].items():
        by_file[fname].append(key)
    tensors: dict[str, torch.Tensor] = {}
    for fname, keys in sorted(by_file.items()):
        with safe_open(str(path / fname), framework="pt") as f:
            for key in keys:
                tensors[key] = f.get_tensor(key)
    return tensors


def _fit_a_log(key: str, value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Kimi's ``A_log``: declared ``[num_heads]``, stored ``[head_dim]`` with zeros past ``num_heads``."""
    n = shape[0] if len(shape) == 1 else -1
    if key.endswith(".A_log") and value.ndim == 1 and value.shape[0] > n > 0 and not value[n:].any():
        return value[:n]
    return value


def build_reference_model(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The checkpoint's own (unpatched) model class, built for real on the CPU in ``dtype``.

    Tiny models only: building for real (no meta device) gives non-persistent buffers the values the
    modules' own ``__init__`` computes. Parameters hold whatever the remote code initialises them to.
    """
    config, cls = load_reference_class(path)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return cls(config)
    finally:
        torch.set_default_dtype(previous)


def fill_reference_model(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Copy ``tensors`` (checkpoint names, dense) into the model's persistent state; returns it in eval mode.

    Raises if any persistent tensor is left unfilled or any given tensor has no place in the model.
    """
    params = model.state_dict(keep_vars=True)  # persistent parameters and buffers only
    filled: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for key, value in tensors.items():
            param = params.get(key)
            if param is None:
                unexpected.append(key)
                continue
            value = _fit_a_log(key, value, tuple(param.shape))
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(f"{key}: checkpoint shape {tuple(value.shape)} != model {tuple(param.shape)}")
            param.copy_(value.to(param.dtype))
            filled.add(key)
    missing = sorted(set(params) - filled)
    if missing or unexpected:
        raise ValueError(f"reference load mismatch: missing={missing[:20]} unexpected={sorted(unexpected)[:20]}")
    return model.eval()


def load_reference_model(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Build the checkpoint's own (unpatched) model class on the CPU and fill its persistent state from disk.

    Parameters take `dtype` except those the remote code creates in fp32 explicitly (as
    from_pretrained would); non-persistent buffers keep their constructed values; MXFP4 experts are
    decoded by compressed-tensors.
    """
    model = build_reference_model(path, dtype)
    tensors = read_checkpoint(path)
    scheme = _mxfp4_scheme(model.config)
    dense = {k: v for k, v in tensors.items() if not k.endswith(_PACKED_SUFFIXES)}
    packed_prefixes = sorted({k[: -len(s)] for k in tensors for s in _PACKED_SUFFIXES if k.endswith(s)})
    for prefix in packed_prefixes:
        dense[f"{prefix}.weight"] = _decode_mxfp4(
            tensors[f"{prefix}.weight_packed"], tensors[f"{prefix}.weight_scale"], scheme
        )
    return fill_reference_model(model, dense)


@torch.no_grad()
def reference_logits(model: torch.nn.Module, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Logits [B, T, V] from a plain forward with use_cache=False."""
    return model(input_ids=input_ids, use_cache=False, **kwargs).logits
