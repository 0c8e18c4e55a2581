"""The held-out passes of a layerwise run (``--eval_kl``, ``--report_heldout``, the report's fidelity section).

A resident run (``quant.evaluate.evaluate_fidelity``) runs each held-out batch twice through the whole model:
quantizers ``off`` (the original) and ``quant`` (the export's numerics), comparing every decoder layer's output
and the logits. A layerwise run never holds the whole model, so the same two passes stream: two caches of
captured layer inputs, the original's and the quantized model's, each advanced through a layer while it is
resident (calibrated and written, not yet released). Per batch, the layer runs once per stream; the two
outputs go to the same ``FidelitySums`` the resident run uses, per layer in batch order, and the last layer
runs to the logits. Same summation order, same layer inputs: the figures equal the resident run's bit for bit
(both streams start from the embeddings, which no recipe quantizes).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from ..quant.activation_stats import held_out_counting
from ..quant.evaluate import Fidelity, FidelitySums
from ..quant.modules import iter_quantizers
from .replay import InputCache, LayerReplay


@contextmanager
def quantizer_modes(module: nn.Module, mode: str) -> Iterator[None]:
    """Every quantizer under ``module`` in ``mode`` for the block, then back as it was."""
    saved = [(q, q.mode) for _, q in iter_quantizers(module)]
    for q, _ in saved:
        q.mode = mode
    try:
        yield
    finally:
        for q, m in saved:
            q.mode = m


class HeldOutStreams:
    """The original and the quantized model's inputs of the current layer, one entry per held-out batch."""

    def __init__(self, model: nn.Module, replay: LayerReplay, batches: list[torch.Tensor], spill_dir: Path,
                 limit_bytes: int) -> None:
        self.model, self.replay, self.batches = model, replay, batches
        self.spill_dir, self.limit = spill_dir, limit_bytes
        self.sums = FidelitySums(list(replay.names), replay.device)
        self.reference = InputCache(spill_dir, limit_bytes, "heldout-ref-00000")
        self.quantized = InputCache(spill_dir, limit_bytes, "heldout-quant-00000")

    @torch.no_grad()
    def capture_first(self) -> None:
        """Layer 0's inputs (the model's own embedding and masks): one capture serves both streams."""
        self.replay.current, self.replay.capture = -1, True
        with quantizer_modes(self.model, "off"):
            for batch in self.batches:
                item = self.replay.step(batch, None)
                self.reference.append(item)
                self.quantized.append(item)

    @torch.no_grad()
    def advance(self, i: int) -> None:
        """Both streams through layer ``i`` (resident, calibrated, written): its outputs compared per batch,
        the next layer's inputs captured (the last layer: the logits compared)."""
        replay, last = self.replay, i == len(self.replay.names) - 1
        replay.current, replay.capture = i, not last
        ref_next = InputCache(self.spill_dir, self.limit, f"heldout-ref-{i + 1:05d}")
        quant_next = InputCache(self.spill_dir, self.limit, f"heldout-quant-{i + 1:05d}")
        for b, batch in enumerate(self.batches):
            with quantizer_modes(self.model, "off"):
                ref_item = replay.step(batch, self.reference[b])
            reference, ref_result = replay.output.detach().clone(), replay.result
            with quantizer_modes(self.model, "quant"):
                held_out_counting(self.model, True)
                try:
                    quant_item = replay.step(batch, self.quantized[b])
                finally:
                    held_out_counting(self.model, False)
            self.sums.add_layer(i, reference, replay.output)
            if last:
                self.sums.add_logits(ref_result.logits, replay.result.logits)
            else:
                ref_next.append(ref_item)
                quant_next.append(quant_item)
        self.reference.discard()
        self.quantized.discard()
        self.reference, self.quantized = ref_next, quant_next

    def result(self) -> Fidelity:
        """The sums over every rank's tokens (one all-reduce: every rank calls it)."""
        return self.sums.result()
