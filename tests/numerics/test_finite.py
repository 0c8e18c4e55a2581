"""Counting non-finite values (numerics/finite.py), the check behind the non-finite policy."""

from __future__ import annotations

import pytest
import torch

from modelopt_k3.numerics.finite import e8m0_nan_count, nonfinite_count


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
