"""What did quantization cost? The fake-quantized model against the unquantized one, on held-out data.

Both come from the same model object: quantizers ``off`` gives the original model, ``quant`` the
fake-quantized one (exactly the exported numerics), so no second copy is held. Per batch: one forward
of each; forward hooks on the spec's decoder layers keep the original pass's layer outputs (one batch
of hidden states per layer, in the model dtype) and compare the quantized pass's to them, so each
layer's figure is the error accumulated up to its output. Logits give KL(p_original || p_quantized)
and top-1 agreement. Run on every rank with the same number of batches (expert-parallel forwards are
collective); sums are over all ranks' tokens (one all-reduce at the end).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..dist.group import current_group
from ..numerics.stats import hidden_error_sums, kl_and_top1, rel_rms
from .activation_stats import held_out_counting
from .modules import iter_quantizers, set_mode


@dataclass
class Fidelity:
    """Sums over every rank's held-out tokens."""

    layers: list[str]  # decoder layer names, forward order
    hidden: list[tuple[float, float]]  # per layer: (sum of squared error, sum of squared original)
    kl_sum: float
    top1_agree: float
    tokens: float

    @property
    def kl(self) -> float:
        return self.kl_sum / self.tokens if self.tokens else float("nan")

    @property
    def top1(self) -> float:
        return self.top1_agree / self.tokens if self.tokens else float("nan")

    def hidden_rel_rms(self) -> list[float]:
        return [rel_rms(sse, ssq) for sse, ssq in self.hidden]


def _first(output):
    return output[0] if isinstance(output, tuple) else output


class FidelitySums:
    """The held-out sums of one run, added batch by batch in one order whoever drives the forwards (the
    resident ``evaluate_fidelity`` or a layerwise run streaming each layer): per layer, its batches' hidden
    error sums in batch order; the logits' KL/top-1 sums in batch order. Same order, same float64 sums,
    so a layerwise run's figures equal the resident run's bit for bit when the layer outputs do."""

    def __init__(self, layers: list[str], device: torch.device) -> None:
        self.layers, self.device = layers, device
        self.hidden = torch.zeros(len(layers), 2, dtype=torch.float64, device=device)
        self.final = torch.zeros(3, dtype=torch.float64, device=device)

    def add_layer(self, index: int, reference: torch.Tensor, quantized: torch.Tensor) -> None:
        """One batch's output of decoder layer ``index``: the original pass's and the quantized pass's."""
        self.hidden[index] += hidden_error_sums(reference, quantized).to(self.device)

    def add_logits(self, reference: torch.Tensor, quantized: torch.Tensor) -> None:
        self.final += kl_and_top1(reference, quantized).to(self.device)

    def result(self) -> Fidelity:
        """Sums over every rank's tokens (one all-reduce: call on every rank)."""
        group = current_group()
        both = torch.cat([self.hidden.reshape(-1), self.final])
        if group.world_size > 1:
            dist.all_reduce(both, group=group.pg)  # a sum over ranks' tokens
        both = both.cpu().tolist()
        n = len(self.layers)
        pairs = [(both[2 * i], both[2 * i + 1]) for i in range(n)]
        kl_sum, agree, tokens = both[2 * n:]
        return Fidelity(list(self.layers), pairs, kl_sum, agree, tokens)


@torch.no_grad()
def evaluate_fidelity(model: nn.Module, layers: dict[str, nn.Module], batches: list[torch.Tensor],
                      device: torch.device) -> Fidelity:
    """Hidden-state error per decoder layer (``layers``: the spec's ``decoder_layers``), KL and top-1 agreement
    of quantized vs original on ``batches``."""
    index = {name: i for i, name in enumerate(layers)}
    sums = FidelitySums(list(layers), device)
    reference: dict[str, torch.Tensor] = {}
    phase = {"quant": False}

    def hook(name: str):
        def record(module, args, output):
            out = _first(output)
            if not phase["quant"]:
                reference[name] = out.detach().clone()
            else:
                sums.add_layer(index[name], reference.pop(name), out)

        return record

    modes = {name: q.mode for name, q in iter_quantizers(model)}
    handles = [m.register_forward_hook(hook(name)) for name, m in layers.items()]
    try:
        for batch in batches:
            ids = batch.to(device)
            phase["quant"] = False
            set_mode(model, "off")
            ref = model(input_ids=ids, use_cache=False).logits
            phase["quant"] = True
            set_mode(model, "quant")
            held_out_counting(model, True)
            quant = model(input_ids=ids, use_cache=False).logits
            held_out_counting(model, False)
            sums.add_logits(ref, quant)
            reference.clear()
    finally:
        held_out_counting(model, False)
        for h in handles:
            h.remove()
        for name, q in iter_quantizers(model):
            q.mode = modes[name]
    return sums.result()


def kl_to_unquantized(model: nn.Module, batches: list[torch.Tensor], device: torch.device) -> float:
    """Mean over tokens of KL(p_original || p_quantized) for next-token distributions, in nats (no per-layer
    errors: no decoder layers are hooked)."""
    return evaluate_fidelity(model, {}, batches, device).kl
