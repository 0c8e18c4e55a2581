"""The report's pure numbers against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from modelopt_k3.numerics.stats import (
    WEIGHT_FIELDS,
    block_flags,
    input_counts,
    kl_and_top1,
    rel_rms,
    weight_rows,
)
from modelopt_k3.report.build import weight_summary

F = {name: i for i, name in enumerate(WEIGHT_FIELDS)}


def test_weight_rows_by_hand():
    src = torch.zeros(2, 1, 16)
    src[0, 0, :4] = torch.tensor([1.0, -2.0, 3.0, 4.0])  # sum of squares 30
    src[1, 0, 0] = 2.0
    dq = src.clone()
    dq[0, 0, 0] = 1.5  # error 0.5
    dq[0, 0, 3] = 3.0  # error -1
    rows = weight_rows(src, dq, block=16, scale=torch.tensor([4.0 / 2688, 2.0 / 2688]))
    assert rows[0, F["sse"]] == 1.25 and rows[0, F["ssq"]] == 30 and rows[0, F["max_abs_err"]] == 1.0
    assert rows[1, F["sse"]] == 0 and rows[1, F["ssq"]] == 4 and rows[0, F["amax"]] == 4.0
    assert rows[:, F["units"]].tolist() == [1, 1] and rows[:, F["saturated"]].tolist() == [0, 0]
    summary = weight_summary(rows.tolist())
    assert summary["rel_rms"] == math.sqrt(1.25 / 34) and summary["rel_max_err"] == 0.25
    assert summary["saturated_fraction"] == 0.0 and summary["underflow_fraction"] == 0.0


def test_block_flags_saturate_and_underflow():
    # Global scale 1/2688 (amax 1): a block of amax 2 asks for the scale 2 * 2688 / 6 = 896 > 448 (saturates);
    # one of amax 1e-6 for 1e-6 * 2688 / 6 = 0.00045 < 2**-9 = 0.00195 (underflows); one of amax 1 for 448 (neither).
    gs = torch.tensor(1.0 / 2688)
    x = torch.zeros(1, 4, 16)
    x[0, 0, 0], x[0, 1, 0], x[0, 2, 0] = 2.0, 1e-6, 1.0  # block 3 is all zero: never counted
    blocks, saturated, underflow = block_flags(x, gs, 16)
    assert (blocks.tolist(), saturated.tolist(), underflow.tolist()) == ([4], [1], [1])


def test_input_counts_and_kl():
    x = torch.tensor([[3.0] + [0.0] * 15, [1e-7] + [0.0] * 15])
    counts = input_counts(x, torch.tensor(2.0), torch.tensor(2.0 / 2688), 16)
    assert counts.tolist() == [32, 1, 2, 1]
    assert input_counts(x, torch.tensor(2.0), torch.tensor(2.0 / 448), None).tolist() == [32, 1, 0, 0]
    logits = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    same = kl_and_top1(logits, logits)
    assert same.tolist() == [0.0, 2.0, 2.0]
    flipped = kl_and_top1(logits, logits.flip(-1))
    assert flipped[1] == 0 and flipped[0] > 0
    assert rel_rms(0.0, 0.0) == 0.0 and rel_rms(1.0, 0.0) == math.inf and rel_rms(1.0, 4.0) == 0.5


def test_public_call_survives_importing_the_package():
    import modelopt_k3
    import modelopt_k3.report.build  # noqa: F401  binds the package module to modelopt_k3.report

    assert callable(modelopt_k3.report) and modelopt_k3.report.report.__name__ == "report"


def test_fp8_fake_quant_of_stacked_experts_is_per_expert():
    """The report's (and the fake-quant forward's) per-tensor FP8 experts: one scale per expert."""
    from modelopt_k3.quant.schemes import FP8_TENSOR

    x = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(0)) * torch.tensor([1.0, 10.0, 100.0]).view(3, 1, 1)
    scales = x.abs().amax(dim=(1, 2)) / 448
    stacked = FP8_TENSOR.fake_quant(x, scales.view(-1, 1, 1))
    assert torch.equal(stacked, torch.stack([FP8_TENSOR.fake_quant(w, s) for w, s in zip(x, scales)]))
    assert not torch.equal(stacked, FP8_TENSOR.fake_quant(x, scales.max()))


def _kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q))


# Two distributions whose KL differs by direction: KL(p || q) = 0.5108..., KL(q || p) = 0.3681...
P_ORIGINAL, Q_QUANTIZED = [0.5, 0.5], [0.9, 0.1]


def test_kl_is_original_against_quantized_not_the_reverse():
    """KL(p_original || p_quantized), the direction the report and --eval_kl name: on data where the two
    directions differ (sum 1.0601 vs 0.9174 nats), the sum equals the forward one to float32 precision, not the reverse."""
    ref = torch.tensor([P_ORIGINAL, [0.25, 0.75]]).log()
    quant = torch.tensor([Q_QUANTIZED, [0.75, 0.25]]).log()
    expected = _kl(P_ORIGINAL, Q_QUANTIZED) + _kl([0.25, 0.75], [0.75, 0.25])
    reverse = _kl(Q_QUANTIZED, P_ORIGINAL) + _kl([0.75, 0.25], [0.25, 0.75])
    assert abs(expected - reverse) > 0.1
    kl_sum, agree, tokens = kl_and_top1(ref, quant).tolist()
    assert kl_sum == pytest.approx(expected, rel=1e-6) and (agree, tokens) == (1.0, 2.0)  # ties pick index 0


class _TwoForwards(torch.nn.Module):
    """No quantizer: evaluate_fidelity's first forward (quantizers off) returns the original logits, the
    second (quantizers on) the quantized ones, so the order it compares them in is what is tested."""

    def __init__(self, original: torch.Tensor, quantized: torch.Tensor):
        super().__init__()
        self.logits = [original, quantized]
        self.calls = 0

    def forward(self, input_ids, use_cache=False):
        out = self.logits[self.calls % 2]
        self.calls += 1
        return type("Out", (), {"logits": out})()


def test_evaluate_fidelity_compares_the_original_pass_against_the_quantized_one():
    from modelopt_k3.quant.evaluate import evaluate_fidelity

    ref = torch.tensor([[P_ORIGINAL]]).log()
    quant = torch.tensor([[Q_QUANTIZED]]).log()
    fid = evaluate_fidelity(_TwoForwards(ref, quant), {}, [torch.zeros(1, 1, dtype=torch.long)], torch.device("cpu"))
    assert fid.kl == pytest.approx(_kl(P_ORIGINAL, Q_QUANTIZED), rel=1e-6) and fid.tokens == 1
