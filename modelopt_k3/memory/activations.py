"""What a model spec tells the memory planner about one calibration forward's activations.

Model-specific (``models/<model>/memory.py`` builds it from the text config); the planner adds the
generic parts: all-to-all buffers, the experts implementation's own tensors, FSDP2 gathers and the
decode workspace.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ActivationModel:
    """Bytes on one rank for a calibration batch of ``tokens`` tokens.

    ``carried``: alive through the whole forward (residual streams, block lists, the layer input).
    ``phases``: the transient peak of each dense phase, by name (attention kinds, dense MLPs, logits);
    the largest one counts. ``moe_block``: the MoE block's own tensors while its routed experts run
    (latent input, router output). ``expert_row_bytes``: what the experts compute per routed (token,
    expert) row besides the input and output rows (gate/up output, the activation's temporaries).
    """

    tokens: int
    carried: int
    phases: dict[str, int]
    moe_block: int
    expert_row_bytes: int
    latent_dim: int  # width of the rows the experts take and return
    top_k: int

    @property
    def largest_phase(self) -> tuple[str, int]:
        return max(self.phases.items(), key=lambda kv: kv[1]) if self.phases else ("none", 0)


F32 = 4


def scores_bytes(batch: int, heads: int, seq: int, b: int) -> int:
    """Attention over ``[B, H, S, S]`` scores as transformers' eager interface computes them: the scores in the
    weight dtype, their fp32 softmax and the probabilities cast back (an upper bound for SDPA's kernels)."""
    return batch * heads * seq * seq * (2 * b + F32)


def gated_mlp_bytes(tokens: int, width: int, b: int) -> int:
    """A gated MLP of intermediate ``width`` in the weight dtype (``down(act(gate(x)) * up(x))``): the gate and
    up outputs, the activation and the product; its output is the caller's."""
    return tokens * width * 4 * b
