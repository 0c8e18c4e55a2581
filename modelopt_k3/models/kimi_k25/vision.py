"""Kimi-K2.5's vision tower and projector as the hub checkpoint stores them: carried, never built.

Text calibration never runs them and NVIDIA's NVFP4 release keeps them BF16, so the pipeline does not build
them: ``SourceCheckSpec.carried`` names every tensor they must store (so a missing or mis-shaped one is refused
from the headers) and every export copies them byte for byte. Their names and shapes are read off transformers'
own ``Kimi_K25VisionModel`` / ``Kimi_K25MultimodalProjection`` built on meta, each renamed to the hub's
MoonViT spelling (``hub_name``: the inverse of transformers' ``kimi_k25`` conversion, which also splits the
fused ``wqkv`` into ``q/k/v_proj``; the hub stores one ``wqkv``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ...spec import CarriedModules

PREFIXES = ("vision_tower", "mm_projector")
REASON = "vision tower / projector (text calibration never runs them; kept BF16 as published)"
_BLOCK_RE = re.compile(r"^model\.vision_tower\.layers\.(?P<i>\d+)\.(?P<rest>.+)$")
# transformers' vision block names -> the original MoonViT names (the inverse of its kimi_k25 renames).
_BLOCK_NAMES = {"norm1": "norm0", "norm2": "norm1", "mlp.fc1": "mlp.fc0", "mlp.fc2": "mlp.fc1", "attn.proj": "wo"}
# The hub's vision_config spelling (remote code, vLLM) -> transformers 5.25's, which reads only its own names
# and otherwise falls back to its defaults (the real sizes: right for the real model, wrong for any other).
_HUB_VISION_FIELDS = {"vt_hidden_size": "hidden_size", "vt_intermediate_size": "intermediate_size",
                      "vt_num_attention_heads": "num_attention_heads", "vt_num_hidden_layers": "num_hidden_layers",
                      "init_pos_emb_height": "pos_emb_height", "init_pos_emb_width": "pos_emb_width",
                      "init_pos_emb_time": "pos_emb_time"}


def hub_name(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """A tensor of transformers' vision tower or projector (``model.vision_tower.*``, ``model.mm_projector.*``)
    -> the hub tensors holding it: one, or none for the k/v thirds of a ``wqkv`` its q third names."""
    if name.startswith("model.mm_projector."):
        rest = name.removeprefix("model.mm_projector.").replace("in_proj.", "proj.0.").replace("out_proj.", "proj.2.")
        return [("mm_projector." + rest, shape)]
    if name == "model.vision_tower.patch_embed.pos_emb.position_embeddings":
        return [("vision_tower.patch_embed.pos_emb.weight", shape)]
    m = _BLOCK_RE.match(name)
    if m is None:  # patch_embed.proj, final_layernorm
        rest = name.removeprefix("model.vision_tower.")
        return [(("vision_tower." if rest.startswith("patch_embed.") else "vision_tower.encoder.") + rest, shape)]
    block, rest = f"vision_tower.encoder.blocks.{m['i']}", m["rest"]
    qkv = re.match(r"attn\.(?P<p>[qkv])_proj\.(?P<t>weight|bias)$", rest)
    if qkv is not None:  # one fused wqkv (transformers chunks it in three and permutes q/k for its rope)
        return [(f"{block}.wqkv.{qkv['t']}", (3 * shape[0], *shape[1:]))] if qkv["p"] == "q" else []
    module, _, tensor = rest.rpartition(".")
    return [(f"{block}.{_BLOCK_NAMES.get(module, module)}.{tensor}", shape)]


def transformers_config(config: Mapping[str, Any]) -> Any:
    """transformers' ``Kimi_K25Config`` of config.json, the hub's ``vt_*`` vision sizes under transformers' names
    (where config.json does not spell them both ways)."""
    from transformers import Kimi_K25Config

    raw = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "quantization_config")}
    vision = dict(raw.get("vision_config") or {})
    for hub, ours in _HUB_VISION_FIELDS.items():
        if hub in vision:
            vision.setdefault(ours, vision[hub])
    return Kimi_K25Config(**{**raw, "vision_config": vision})


def vision_tensors(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every hub tensor of the vision tower and projector config.json describes -> its shape (built on meta)."""
    import torch
    from transformers.models.kimi_k25.modeling_kimi_k25 import (
        Kimi_K25MultimodalProjection,
        Kimi_K25VisionModel,
    )

    cfg = transformers_config(config)
    with torch.device("meta"):
        parts = {"model.vision_tower": Kimi_K25VisionModel(cfg.vision_config),
                 "model.mm_projector": Kimi_K25MultimodalProjection(cfg)}
    out: dict[str, tuple[int, ...]] = {}
    for prefix, module in parts.items():
        for name, t in module.state_dict().items():
            for hub, shape in hub_name(f"{prefix}.{name}", tuple(t.shape)):
                out.setdefault(hub, shape)
    return out


def carried_modules(config: Mapping[str, Any]) -> CarriedModules:
    """``SourceCheckSpec.carried``: the vision tower and projector, every tensor as stored."""
    return CarriedModules(PREFIXES, vision_tensors(config), REASON)
