"""The compressed-tensors ``nvfp4-pack-quantized`` layout (second export format; vLLM's CT MoE path).

Same codes and block scales as the ModelOpt layout; the tensors are renamed and the global scales are
the reciprocals (FORMATS.md): ``weight_global_scale = 1 / weight_scale_2``,
``input_global_scale = 1 / input_scale``, both fp32 ``[1]``. The ``quantization_config`` is built
with compressed-tensors' own scheme presets and config model, so its field names and defaults are the
library's. Only NVFP4 (W4A4) and weight-only NVFP4 recipes map onto one ``config_group`` here.
"""

from __future__ import annotations

import torch

from ..quant.schemes import SCHEMES, KvCacheFormat

FORMAT_NAME = "nvfp4-pack-quantized"


def supported_algo(algo: str) -> bool:
    return SCHEMES[algo].ct_preset is not None


def unexpressible(algos: set[str], kv_cache: KvCacheFormat | None) -> str | None:
    """Why this format cannot hold a model with these quantization algorithms, or None if it can."""
    if len(algos) == 1 and supported_algo(next(iter(algos))) and kv_cache is None:
        return None
    presets = [s.algo for s in SCHEMES.values() if s.ct_preset is not None]
    return (f"format 'compressed-tensors' writes one NVFP4 scheme ({' or '.join(presets)}) without KV-cache "
            f"scales; this recipe gives {sorted(algos)} (kv_cache={kv_cache})")


def rename_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4 tensors of one Linear -> compressed-tensors names and scale conventions."""
    out = {"weight_packed": tensors["weight"], "weight_scale": tensors["weight_scale"]}
    out["weight_global_scale"] = (1.0 / tensors["weight_scale_2"].to(torch.float32)).reshape(1)
    if "input_scale" in tensors:
        out["input_global_scale"] = (1.0 / tensors["input_scale"].to(torch.float32)).reshape(1)
    return out


def quantization_config(algo: str, ignore: list[str]) -> dict:
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme(SCHEMES[algo].ct_preset, ["Linear"])
    config = QuantizationConfig(
        config_groups={"group_0": scheme}, format=FORMAT_NAME, quantization_status="compressed", ignore=ignore
    )
    return config.model_dump(mode="json", exclude_none=True)
