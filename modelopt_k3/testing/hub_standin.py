"""What the stand-ins of transformers-native models (Kimi-K2.5, Nemotron-H, GLM-5, Qwen3.5-MoE, MiniMax-M2) share.

Each of them builds transformers' own model on the meta device from its own config class, which gives every
tensor's name and shape as transformers holds it; a model module then says how its hub checkpoint spells and
shapes the same weights (``hub_layout``: the prefix moves, per-expert Linears where transformers fuses the
experts, a fused qkv where transformers splits it). The values are drawn here, keyed by the hub name only
(``tiny._tensor_generator``), so the same seed and sizes give the same bytes and a tensor's values do not
depend on the other tensors."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .tiny import _tensor_generator

# A transformers name and shape -> the hub (name, shape) pairs that hold it (several for fused experts,
# none for the k/v parts of a fused qkv that its q part already wrote).
HubLayout = Callable[[str, tuple[int, ...]], list[tuple[str, tuple[int, ...]]]]

FUSED_EXPERT_RE = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<param>gate_up_proj|up_proj|down_proj)$")


def meta_model(model_cls: Any, config: Any) -> Any:
    """transformers' own model built on the meta device (names and shapes only, no memory)."""
    with torch.device("meta"):
        return model_cls(config)


def persistent_tensors(model: Any) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor ``from_pretrained`` fills: parameters, then persistent buffers."""
    for name, param in model.named_parameters():
        yield name, tuple(param.shape)
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield f"{module_name}.{name}", tuple(buf.shape)


def per_expert(name: str, shape: tuple[int, ...], projs: dict[str, tuple[str, ...]]) -> list[tuple[str, tuple[int, ...]]]:
    """transformers' fused experts tensor ``name`` (``[E, rows, cols]``) as the hub's per-expert Linears:
    ``projs`` maps the fused parameter (``gate_up_proj``, ``down_proj``, ``up_proj``) to the hub's projection
    names in the fused rows' order (gate first, as transformers' ``Concatenate(dim=1)`` puts it)."""
    m = FUSED_EXPERT_RE.match(name)
    if m is None:
        raise ValueError(f"{name} is not a fused experts tensor")
    num_experts, rows, cols = shape
    names = projs[m["param"]]
    return [(f"{m['prefix']}.{e}.{proj}.weight", (rows // len(names), cols)) for e in range(num_experts)
            for proj in names]


def draw(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """fp32 values for hub tensor ``name``: norms near 1, router bias small, the rest ~unit output variance."""
    randn = torch.randn(shape, generator=_tensor_generator(seed, name))
    if name.endswith(("norm.weight", "norm0.weight", "norm1.weight", "norm_f.weight")):
        return 1.0 + 0.05 * randn
    if name.endswith(("e_score_correction_bias", ".bias")):
        return 0.01 * randn
    if name.endswith(("embed_tokens.weight", "embeddings.weight", "pos_emb.weight", "pos_embed.weight")):
        return randn
    if name.endswith("A_log"):
        # Mamba-2 / gated-delta-net decay: A = -exp(A_log) in (-4, -1), as trained models keep it.
        return torch.log(1.0 + 3.0 * torch.rand(shape, generator=_tensor_generator(seed, name + "#A")))
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
    return randn / math.sqrt(fan_in)


def hub_shapes(model: Any, layout: HubLayout) -> list[tuple[str, tuple[int, ...]]]:
    """Every hub tensor of ``model`` in module-tree order (each once)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in persistent_tensors(model):
        for hub_name, hub_shape in layout(name, shape):
            out.setdefault(hub_name, hub_shape)
    return list(out.items())


def bf16_tensors(shapes: Iterable[tuple[str, tuple[int, ...]]], seed: int,
                 fp32: Callable[[str], bool] = lambda name: False) -> Iterator[tuple[str, torch.Tensor]]:
    """The drawn tensors in BF16, those ``fp32`` names kept fp32 (routers' score-correction biases)."""
    for name, shape in shapes:
        value = draw(name, shape, seed)
        yield name, value if fp32(name) else value.to(torch.bfloat16)
