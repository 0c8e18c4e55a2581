"""Unit tests of the pieces behind ``tests/faults``: counting non-finite values, the Kimi-K3 expert layout
read from config.json, the shared expert check, and how failures are grouped into lines."""

from __future__ import annotations

import pytest
import torch

from modelopt_k3.cli._common import failure_lines
from modelopt_k3.dist.collectives import DistributedStepError
from modelopt_k3.models.kimi_k3 import KIMI_K3_SPEC
from modelopt_k3.models.kimi_k3.layout import expert_layout
from modelopt_k3.models.spec import SpecError
from modelopt_k3.numerics.finite import e8m0_nan_count, nonfinite_count
from modelopt_k3.source_check import SourceMismatchError, check_experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_count_counts_nan_and_both_infinities(dtype) -> None:
    x = torch.zeros(1000, dtype=dtype)
    assert nonfinite_count(x) == 0 and nonfinite_count(x[:0]) == 0
    x[3], x[500], x[999] = float("nan"), float("inf"), float("-inf")
    x[7] = torch.finfo(dtype).max  # the largest finite value is finite
    assert nonfinite_count(x) == 3


def test_nonfinite_count_of_float8_and_integers() -> None:
    e4m3 = torch.tensor([0x7F, 0xFF, 0x7E, 0x00], dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaN, -NaN, 448, 0
    assert nonfinite_count(e4m3) == 2
    e5m2 = torch.tensor([0x7C, 0xFC, 0x7D, 0x7B], dtype=torch.uint8).view(torch.float8_e5m2)  # +Inf, -Inf, NaN, max
    assert nonfinite_count(e5m2) == 3
    assert nonfinite_count(torch.full((4,), 255, dtype=torch.uint8)) == 0


def test_e8m0_nan_is_byte_255_only() -> None:
    scales = torch.arange(256, dtype=torch.uint8)
    assert e8m0_nan_count(scales) == 1 and e8m0_nan_count(scales[:255]) == 0
    with pytest.raises(TypeError):
        e8m0_nan_count(scales.to(torch.int16))


def _text(**fields) -> dict:
    base = {"num_experts": 4, "moe_intermediate_size": 64, "hidden_size": 128, "num_hidden_layers": 6}
    return {"text_config": {**base, **fields}}


def test_kimi_expert_layout_follows_the_remote_codes_moe_layer_rule() -> None:
    layouts = expert_layout(_text(first_k_dense_replace=1, moe_layer_freq=2, routed_expert_hidden_size=32))
    assert [lay.module.split(".")[3] for lay in layouts] == ["2", "4"]  # i >= 1 and i % 2 == 0
    assert dict(layouts[0].projections) == {"w1": (64, 32), "w3": (64, 32), "w2": (32, 64)}
    assert [lay.module.split(".")[3] for lay in expert_layout(_text())] == ["0", "1", "2", "3", "4", "5"]
    assert expert_layout(_text())[0].projections["w2"] == (128, 64)  # no latent size: hidden_size
    assert expert_layout(_text(num_experts=None)) == ()
    with pytest.raises(SpecError, match="moe_intermediate_size"):
        expert_layout(_text(moe_intermediate_size=0))


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
    config = _text(num_hidden_layers=2)
    for packed in (True, False):
        tensors = {**_experts(0, 4, packed=packed), **_experts(1, 4, packed=packed)}
        assert check_experts(tensors, config, KIMI_K3_SPEC).packed_experts is packed
    with pytest.raises(SourceMismatchError, match="mixes MXFP4-packed and plain"):
        check_experts({**_experts(0, 4, packed=True), **_experts(1, 4, packed=False)}, config, KIMI_K3_SPEC)
    with pytest.raises(SourceMismatchError, match=r"24 missing: .*layers\.1\.block_sparse_moe\.experts\.0\.w1"):
        check_experts(_experts(0, 4, packed=True), config, KIMI_K3_SPEC)  # layer 1 stores no experts


def test_failures_are_one_line_per_group_of_ranks_printed_by_rank_0() -> None:
    failures = {0: "ValueError: a\nb", 1: "ValueError: a\nb", 2: "ValueError: a\nb", 5: "LoadError: c"}
    seen_by_0 = DistributedStepError("load", failures, rank=0)
    assert failure_lines(seen_by_0) == ["load failed on ranks 0-2: ValueError: a b", "load failed on rank 5: LoadError: c"]
    assert failure_lines(DistributedStepError("load", failures, rank=3)) is None
    # A peer died before the ranks could agree: every rank reports what it saw.
    assert failure_lines(DistributedStepError("load", {}, rank=3, note="peer gone")) == [
        "step 'load' failed (seen from rank 3): peer gone"]
