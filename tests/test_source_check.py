"""The shared expert check of checkpoint headers against config.json (source_check.py)."""

from __future__ import annotations

import pytest
import torch

from modelopt_k3.checkpoint.source_check import SourceMismatchError, check_experts
from modelopt_k3.models.kimi_k3 import KIMI_K3_SPEC


class _Meta:
    def __init__(self, dtype, shape):
        self.dtype, self.shape = dtype, tuple(shape)


def _experts(layer: int, n: int, *, packed: bool) -> dict[str, _Meta]:
    out = {}
    for e in range(n):
        for proj, (o, i) in {"w1": (64, 128), "w3": (64, 128), "w2": (128, 64)}.items():
            key = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.{proj}"
            if packed:
                out[f"{key}.weight_packed"] = _Meta(torch.uint8, (o, i // 2))
                out[f"{key}.weight_scale"] = _Meta(torch.uint8, (o, i // 32))
            else:
                out[f"{key}.weight"] = _Meta(torch.bfloat16, (o, i))
    return out


def test_check_experts_accepts_complete_packed_or_plain_and_refuses_a_mix() -> None:
    config = {"text_config": {"num_experts": 4, "moe_intermediate_size": 64, "hidden_size": 128, "num_hidden_layers": 2}}
    for packed in (True, False):
        tensors = {**_experts(0, 4, packed=packed), **_experts(1, 4, packed=packed)}
        assert check_experts(tensors, config, KIMI_K3_SPEC).packed_experts is packed
    with pytest.raises(SourceMismatchError, match="mixes MXFP4-packed and plain"):
        check_experts({**_experts(0, 4, packed=True), **_experts(1, 4, packed=False)}, config, KIMI_K3_SPEC)
    with pytest.raises(SourceMismatchError, match=r"24 missing: .*layers\.1\.block_sparse_moe\.experts\.0\.w1"):
        check_experts(_experts(0, 4, packed=True), config, KIMI_K3_SPEC)  # layer 1 stores no experts
