"""quant/calibrators/gptq.py: routed experts solved in batches (``_update_experts``), chunked by ``BATCH_BYTES``,
equal to solving each expert alone; experts no token reached keep their weight."""

from __future__ import annotations

import pytest
import torch

from modelopt_k3.numerics import nvfp4_block_scales, nvfp4_global_scale
from modelopt_k3.numerics.gptq import gptq_batch_bytes, nvfp4_gptq
from modelopt_k3.quant.calibrators import calibrator_for
from modelopt_k3.quant.calibrators import gptq as gptq_calibrator


class _Sums:
    """``ExpertSums``' two calls the update makes: ``pop`` (float64 sums and tokens, None when idle), ``clear``."""

    def __init__(self, by_expert: dict[int, tuple[torch.Tensor, int]]) -> None:
        self.by_expert = dict(by_expert)
        self.cleared = False

    def pop(self, expert: int) -> tuple[torch.Tensor, int] | None:
        return self.by_expert.pop(expert, None)

    def clear(self) -> None:
        self.cleared = True


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_batched_experts_equal_one_at_a_time_in_any_chunking(monkeypatch, chunk):
    n_exp, out_f, in_f = 7, 24, 64
    g = torch.Generator().manual_seed(9)
    weight = torch.randn(n_exp, out_f, in_f, generator=g).bfloat16()
    gs = torch.stack([nvfp4_global_scale(weight[e].float().abs().amax()) for e in range(n_exp)])
    scales = torch.stack([nvfp4_block_scales(weight[e], gs[e]) for e in range(n_exp)])
    idle = {2, 5}
    sums = {}
    for e in range(n_exp):
        if e not in idle:
            x = torch.randn(40 + e, in_f, generator=g).double()
            sums[e] = (x.T @ x, x.shape[0])
    per_expert = gptq_batch_bytes(out_f, in_f, 32) + 4 * in_f * in_f + 4 * out_f * in_f
    monkeypatch.setattr(gptq_calibrator, "BATCH_BYTES", chunk * per_expert + per_expert // 2)
    solver = calibrator_for({"method": "gptq", "block_size": 32})
    calls = []
    real = gptq_calibrator.nvfp4_gptq_batched
    monkeypatch.setattr(gptq_calibrator, "nvfp4_gptq_batched", lambda w, *a: calls.append(w.shape[0]) or real(w, *a))
    holder = _Sums(sums)
    updated, idle_count = solver._update_experts(holder, weight, gs, scales)
    assert idle_count == len(idle) and holder.cleared and updated.dtype == weight.dtype
    active = n_exp - len(idle)
    assert calls == [min(chunk, active - i) for i in range(0, active, chunk)]  # chunks of the experts with tokens
    for e in range(n_exp):
        if e in idle:
            assert torch.equal(updated[e], weight[e])
            continue
        total, tokens = sums[e]
        h = (2.0 * total / tokens).to(torch.float32)
        want = nvfp4_gptq(weight[e], h, gs[e], scales[e], 0.01, 32).to(weight.dtype)
        assert torch.equal(updated[e].view(torch.int16), want.view(torch.int16)), e
