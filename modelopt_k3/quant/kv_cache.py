"""KV-cache quantizers on the sites a model adapter declares (``QuantSpec.kv_cache_sites``).

One ``TensorQuantizer`` per site, held as ``attention.kv_cache_quantizer``, observes (``calib``) or
fake-quantizes (``quant``) every cached output through forward hooks; the exporter writes its scale
under each of the site's ``kv_scale_names``.
"""

from __future__ import annotations

import torch

from ..spec.kv_cache import CachedOutput, KvCacheSite
from .quantizer import TensorQuantizer
from .schemes import KvCacheFormat


def _cached_output_hook(quantizer: TensorQuantizer, start: int | None):
    def hook(module, args, output):
        if quantizer.mode == "off":
            return None
        new = quantizer(output if start is None else output[..., start:])
        if quantizer.mode != "quant":
            return None
        return new if start is None else torch.cat([output[..., :start], new], dim=-1)

    return hook


def _attach_site(site: KvCacheSite, fmt: KvCacheFormat) -> None:
    first: CachedOutput = site.outputs[0]
    device = next(first.module.parameters()).device
    q = TensorQuantizer(fmt.tensor, role="input").to(device)
    site.attention.kv_cache_quantizer = q
    site.attention.kv_scale_names = site.scale_names
    for out in site.outputs:
        out.module.register_forward_hook(_cached_output_hook(q, out.start))


def attach_kv_cache(sites: list[KvCacheSite], fmt: KvCacheFormat) -> None:
    if not sites:
        raise ValueError(f"kv_cache={fmt} was requested but the model declares no KV-cache site (no MLA attention layer)")
    for site in sites:
        _attach_site(site, fmt)
