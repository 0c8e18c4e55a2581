"""What did quantization cost? KL divergence of the fake-quantized model from the unquantized one.

Both distributions come from the same model object: quantizers ``off`` gives the original model,
``quant`` the fake-quantized one (exactly the exported numerics), so no second copy is held. Run on
every rank with the same number of batches (expert-parallel forwards are collective); the result is
averaged over all ranks' tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..dist.group import current_group
from .modules import iter_quantizers, set_mode


@torch.no_grad()
def kl_to_unquantized(model: nn.Module, batches: list[torch.Tensor], device: torch.device) -> float:
    """Mean over tokens of KL(p_original || p_quantized) for next-token distributions, in nats."""
    modes = {name: q.mode for name, q in iter_quantizers(model)}
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [sum of KL, token count]
    try:
        for batch in batches:
            ids = batch.to(device)
            set_mode(model, "off")
            ref = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), dim=-1)
            set_mode(model, "quant")
            quant = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), dim=-1)
            kl = (ref.exp() * (ref - quant)).sum(-1)
            total += torch.stack([kl.sum().double(), torch.tensor(kl.numel(), dtype=torch.float64, device=device)])
    finally:
        for name, q in iter_quantizers(model):
            q.mode = modes[name]
    group = current_group()
    if group.world_size > 1:
        dist.all_reduce(total, group=group.pg)  # a sum over ranks' tokens
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")

