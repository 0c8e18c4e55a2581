"""transformers' own gated experts instances on the experts base (``experts/base.py``), for any model whose
experts class stores ``gate_up_proj [E, 2I, H]`` (rows ``[:I]`` gate, ``[I:]`` up) and ``down_proj [E, H, I]``
behind transformers' experts interface (Qwen3-MoE, DeepSeek-V3, and the models transformers defines the same way).

transformers' eager forward computes ``act(gate) * up`` inline, so nothing could quantize the down
projection's input, and it knows nothing of a placement. ``fused_experts_class(base)`` is therefore a subclass
of the experts base and of transformers' class (never transformers' class itself) that sends the gate through
``_apply_gate`` (where ``down_input_hook`` applies) and supplies transformers' eager combine, the one the eager
forward, ``torch_a2a`` and chunked packed decode all use; ``experts_placer(base)`` re-classes each built
instance to it and narrows it to the placement.

Numerics are transformers' eager ones, bit for bit: per expert (ascending id) ``linear`` of the tokens routed to
it, ``act(gate) * up``, ``linear`` down, times the routing weight, accumulated into a zero tensor of the hidden
dtype in ascending expert order (``index_add_``: one rounding per added expert).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ...dist.placement import ExpertPlacement
from ...experts.base import FusedExperts
from .lazy import ClassRef, modeling_class, resolve_class


def combine_in_expert_order(
    per_slot: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """transformers' eager combine of bare expert outputs ``per_slot [N, k, H]``.

    Each output times its weight, rounded to ``dtype``, then added to a zero ``[N, H]`` accumulator one
    expert at a time in ascending global expert id (what ``index_add_`` over ``expert_hit`` does). The
    fp32 product of two BF16 values is exact, so rounding it once equals transformers' BF16 multiply.
    """
    weighted = (per_slot.float() * top_k_weights.float().unsqueeze(-1)).to(dtype)
    order = top_k_index.argsort(dim=1, stable=True)  # top-k ids of a token are distinct
    weighted = weighted.gather(1, order.unsqueeze(-1).expand_as(weighted))
    acc = torch.zeros(per_slot.shape[0], per_slot.shape[2], dtype=dtype, device=per_slot.device)
    for j in range(weighted.shape[1]):
        acc = acc + weighted[:, j]
    return acc


class GatedExpertsMath:
    """The math a transformers gated experts class computes inline, as the experts base's two hooks."""

    act_fn: Callable[[torch.Tensor], torch.Tensor]

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def combine(self, per_slot: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """Bare outputs ``[N, k, H]`` of ``top_k_index``'s experts -> the layer output (transformers' order)."""
        return combine_in_expert_order(per_slot, top_k_index, top_k_weights, dtype)


_FUSED: dict[type, type] = {}


def fused_name(base: type) -> str:
    """``Qwen3MoeExperts`` -> ``Qwen3MoeFusedExperts`` (the name the model package exports)."""
    name = base.__name__
    return f"{name[:-len('Experts')]}FusedExperts" if name.endswith("Experts") else f"Fused{name}"


def fused_experts_class(base: type) -> type:
    """What a built instance of transformers' ``base`` becomes on a model this project loads: one class per
    ``base`` (``adopt`` tests ``isinstance``), never constructed directly. The base's eager loop runs the same
    per-expert matmuls as transformers' (its forward casts tokens to the weight dtype first: they are equal)."""
    if base not in _FUSED:
        # Imported here: it imports torch's compiler stack, which only a built model needs (``lazy.py``).
        from transformers.integrations.moe import use_experts_implementation

        cls = type(fused_name(base), (GatedExpertsMath, FusedExperts, base), {
            "__module__": __name__,
            "__doc__": f"transformers' ``{base.__name__}`` with our placement, hooks and its eager combine.",
        })
        _FUSED[base] = use_experts_implementation(is_concatenated=True, is_transposed=False, has_bias=False,
                                                  has_gate=True)(cls)
    return _FUSED[base]


def lazy_fused_experts(model: str, base: str) -> Callable[[], type]:
    """``fused_experts_class`` of transformers' ``base`` in ``model``'s modeling module, made when called (a
    package's public ``...FusedExperts`` through its ``lazy_attrs``)."""
    return lambda: fused_experts_class(modeling_class(model, base)())


def experts_placer(base: ClassRef) -> Callable[[nn.Module, ExpertPlacement], None]:
    """``ExpertsSpec.place_experts`` for ``base`` (the class, or a function giving it on the first placement: a
    spec is read without building a model): every instance in the model re-classed and narrowed to the
    placement's experts (it must hold them all, e.g. on meta)."""

    def place_experts(model: nn.Module, placement: ExpertPlacement) -> None:
        cls = resolve_class(base)
        fused = fused_experts_class(cls)
        for module in model.modules():
            if isinstance(module, cls):
                fused.adopt(module)
                module.place(placement)

    if isinstance(base, type):
        place_experts.__qualname__ = f"place_experts[{base.__name__}]"
    return place_experts
