"""The one fused-experts base: what every model's routed-experts module shares.

A model's experts module (``models/<model>/experts.py``) subclasses ``FusedExperts`` and supplies only
its own math:

* ``activation(gate_up)``: the gate, from the gate/up projection's output ``[.., 2I]`` to the down
  projection's input ``[.., I]`` (where the model keeps gate and up rows is its business);
* its biases, by declaring ``has_bias=True`` to ``use_experts_implementation`` (transformers' flag, read
  by every implementation) and holding ``gate_up_proj_bias [E, 2I]`` / ``down_proj_bias [E, H]``;
* ``combine(per_slot, ids, weights, dtype)`` if its reference combines the k expert outputs of a token
  otherwise than in fp32 (``combine_fp32``, the default).

Everything else is here, once: the placement (``placement``, ``place``, ``num_global_experts``,
``expert_offset``, ``extra_repr``), the ``down_input_hook`` convention (``_apply_gate``: the model's
activation, then the hook, the one point where a quantization layer quantizes the down input), the
``owner_input_hook`` (what the local experts receive, on their owner) and the
eager implementation (sort the (token, slot) pairs by expert, one matmul pair per expert that received
tokens, scatter back, ``combine``). The same ``combine`` closes the other runs of a layer: ``torch_a2a``
(``experts/dispatch.py``) and chunked packed decode (``experts/packed.py``).

Tensors: ``E`` local experts, ``H`` hidden, ``I`` intermediate, ``N`` tokens, ``k`` experts per token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..dist.placement import ExpertPlacement

WEIGHTS = ("gate_up_proj", "down_proj")
BIASES = ("gate_up_proj_bias", "down_proj_bias")


def combine_fp32(
    per_slot: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Bare expert outputs ``per_slot [N, k, H]`` times their weights, summed over k in fp32, cast to ``dtype``."""
    del top_k_index  # the fp32 sum does not depend on the order of a token's experts
    return (per_slot.float() * top_k_weights.float().unsqueeze(-1)).sum(1).to(dtype)


class FusedExperts(nn.Module):
    """Routed experts of one MoE layer held fused (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``),
    ``E`` of them the ones this rank holds (``placement``), behind transformers' experts interface.

    Never instantiated itself: a model subclass decorates itself with ``use_experts_implementation`` and
    either builds its parameters (and ``placement = ExpertPlacement(num_experts)``) in ``__init__`` or
    re-classes a built transformers instance (``adopt``).
    """

    # Applied to the down projection's input (after the activation) by every implementation, through
    # _apply_gate: the declared point where a quantization layer quantizes that input (quant/modules.py).
    down_input_hook: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Called on the rank that runs the local experts with what they receive, ``(module, hidden [M, H], local
    # ids [M, k])``, before they run: the owner-side point where a calibrator reads each expert's routed
    # tokens (``experts.dispatch.owner_inputs`` sets it; ``torch_a2a`` calls it on the owner).
    owner_input_hook: Callable[[nn.Module, torch.Tensor, torch.Tensor], None] | None = None
    placement: ExpertPlacement
    num_experts: int  # local experts (the experts interface reads it)
    hidden_dim: int
    intermediate_dim: int
    has_bias: bool  # set by use_experts_implementation

    # ------------------------------------------------------------------ what the model supplies

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[.., 2I]`` gate/up projection output -> ``[.., I]`` down projection input (the model's gate)."""
        raise NotImplementedError(f"{type(self).__name__} must define activation(gate_up)")

    def combine(
        self, per_slot: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Bare outputs ``[N, k, H]`` of ``top_k_index``'s experts -> the layer output ``[N, H]`` in ``dtype``."""
        return combine_fp32(per_slot, top_k_index, top_k_weights, dtype)

    # ------------------------------------------------------------------ placement

    @classmethod
    def adopt(cls, module: nn.Module) -> None:
        """Re-class a built instance of ``cls``'s transformers parent as ``cls``, holding all its experts
        (once: an instance already of ``cls`` keeps its placement)."""
        if not isinstance(module, cls):
            module.__class__ = cls
            module.placement = ExpertPlacement(module.num_experts)

    @property
    def fused_params(self) -> tuple[str, ...]:
        """The parameters indexed by expert on dim 0 (``place`` keeps the placement's rows of each)."""
        return WEIGHTS + BIASES if self.has_bias else WEIGHTS

    @property
    def expert_offset(self) -> int:
        return self.placement.local.start

    @property
    def num_global_experts(self) -> int:
        return self.placement.num_experts

    def place(self, placement: ExpertPlacement) -> None:
        """Keep only ``placement``'s experts (call on a module that holds them all, e.g. built on meta)."""
        if (self.placement.ep_size, placement.num_experts) != (1, self.num_experts):
            raise ValueError(
                f"place() needs a module holding all {placement.num_experts} experts; this one holds "
                f"{self.num_experts} of {self.num_global_experts}"
            )
        local = placement.local
        for name in self.fused_params:
            param = self._parameters[name]
            self._parameters[name] = nn.Parameter(param.data[local.start : local.stop].clone(), param.requires_grad)
        self.num_experts = len(local)
        self.placement = placement

    def __len__(self) -> int:
        return self.num_experts

    def extra_repr(self) -> str:
        first = self.expert_offset
        return (
            f"experts={self.num_experts} (global {first}..{first + self.num_experts - 1} of "
            f"{self.num_global_experts}), hidden={self.hidden_dim}, intermediate={self.intermediate_dim}"
        )

    # ------------------------------------------------------------------ running

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        # transformers' implementations call this between the projections; the hook sees the activation.
        out = self.activation(gate_up_out)
        return out if self.down_input_hook is None else self.down_input_hook(out)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Eager implementation: one matmul pair per expert that received tokens.

        ``hidden_states [N, H]``, ``top_k_index [N, k]`` local expert ids, ``top_k_weights [N, k]``.
        Weights, biases and ``num_experts`` are read from ``self`` only (the packed runtime calls this on a
        view holding the decoded weights); ``_apply_gate`` and ``combine`` are the module's.
        """
        num_tokens, top_k = top_k_index.shape
        gate_up, down = self.gate_up_proj, self.down_proj
        gate_up_bias, down_bias = (self.gate_up_proj_bias, self.down_proj_bias) if self.has_bias else (None, None)
        flat_ids = top_k_index.reshape(-1)
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        tokens = hidden_states[order // top_k]
        outputs = torch.empty(flat_ids.numel(), self.hidden_dim, dtype=down.dtype, device=hidden_states.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            x = tokens[rows].to(gate_up.dtype)
            h = self._apply_gate(nn.functional.linear(x, gate_up[expert], _row(gate_up_bias, expert)))
            outputs[rows] = nn.functional.linear(h, down[expert], _row(down_bias, expert))
            start += count
        per_slot = torch.empty_like(outputs)
        per_slot[order] = outputs
        return self.combine(per_slot.view(num_tokens, top_k, -1), top_k_index, top_k_weights, hidden_states.dtype)


def _row(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if bias is None else bias[expert]
