"""What every model's ``QuantSpec.probe_model`` returns: its tiny model, fp32, in eval mode, with small random
weights (seed 0, N(0, 0.02)), so routing and the probe forward see finite values whatever the classes' own
initialisation leaves (the remote ``_init_weights`` leaves garbage)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def random_probe_model(build: Callable[[], nn.Module], device: torch.device) -> nn.Module:
    """``build()`` on the CPU, filled as above, then moved to ``device``."""
    with torch.device("cpu"):
        model = build().float().eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    return model.to(device)
