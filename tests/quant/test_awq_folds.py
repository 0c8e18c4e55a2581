"""``awq``'s v -> o and up -> down pairs (quant/calibrators/awq_folds.py), found from the forward of toy modules:
which Linear's output rows a consumer's input channels are, whether the pair mixes tokens (attention over v) or
is token-wise (the MLP's product), and why a pair found is not folded. The folds on a model:
tests/models/qwen3_moe/test_awq.py."""

from __future__ import annotations

from contextlib import ExitStack
from types import SimpleNamespace

import torch
from torch import nn

from modelopt_k3.quant.calibrators.awq_folds import PairFinder
from modelopt_k3.quant.schemes import NVFP4_TENSOR


def _quantized(lin: nn.Linear, fmt=NVFP4_TENSOR) -> nn.Linear:
    lin.weight_quantizer = SimpleNamespace(fmt=fmt, block_source=None)  # what the finder reads of a quantizer
    return lin


class _GatedMlp(nn.Module):
    def __init__(self, bias: bool = False, fmt=NVFP4_TENSOR) -> None:
        super().__init__()
        self.gate_proj = _quantized(nn.Linear(16, 32, bias=False))
        self.up_proj = _quantized(nn.Linear(16, 32, bias=bias))
        self.down_proj = _quantized(nn.Linear(32, 16, bias=False), fmt)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _SquaredReluMlp(nn.Module):  # Nemotron-H's: no gate, the input of down is up's output squared
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = _quantized(nn.Linear(16, 32, bias=False))
        self.down_proj = _quantized(nn.Linear(32, 16, bias=False))

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x)) ** 2)


class _Attention(nn.Module):
    """Causal attention with 4 query heads over 2 kv heads of 4 dims (GQA): o's 16 input channels repeat v's 8."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = _quantized(nn.Linear(16, 16, bias=False))
        self.k_proj = _quantized(nn.Linear(16, 8, bias=False))
        self.v_proj = _quantized(nn.Linear(16, 8, bias=False))
        self.o_proj = _quantized(nn.Linear(16, 16, bias=False))

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, 4, 4).transpose(1, 2)
        k, v = (p(x).view(b, t, 2, 4).transpose(1, 2).repeat_interleave(2, dim=1) for p in (self.k_proj, self.v_proj))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, 16))


def _find(module: nn.Module, v_o: bool = False, up_down: bool = True) -> PairFinder:
    torch.manual_seed(0)
    finder = PairFinder(module, v_o, up_down)
    with ExitStack() as stack, torch.no_grad():
        finder.hooks(stack)
        module(torch.randn(2, 8, 16))
        module(torch.randn(2, 8, 16))  # the second call sums statistics, probes nothing
    return finder


def test_a_gated_mlps_up_rows_are_down_inputs_token_wise_with_its_statistics_summed():
    finder = _find(_GatedMlp())
    pair = finder.pairs["up_proj -> down_proj"]
    assert not pair.across_tokens and not pair.experts and torch.equal(pair.row_map, torch.arange(32))
    assert float(pair.tokens[0]) == 32  # both calls' 16 tokens, none of the probes'
    assert set(finder.pairs) == {"up_proj -> down_proj"} and not finder.skipped  # the gate reaches down non-linearly


def test_gqa_attention_maps_each_v_row_to_the_o_channels_that_repeat_it_and_mixes_tokens():
    finder = _find(_Attention(), v_o=True)
    pair = finder.pairs["v_proj -> o_proj"]
    assert pair.across_tokens
    assert torch.equal(pair.row_map, torch.tensor([(i // 8) * 4 + i % 4 for i in range(16)]))
    assert set(finder.pairs) == {"v_proj -> o_proj"}  # q and k reach o through the softmax


def test_pairs_found_but_not_folded_say_why():
    assert "off by default (fold_v_o)" in _find(_Attention()).skipped["v_proj -> o_proj"]
    assert "fold_up_down is off" in _find(_GatedMlp(), up_down=False).skipped["up_proj -> down_proj"]
    assert "up_proj has a bias" in _find(_GatedMlp(bias=True)).skipped["up_proj -> down_proj"]
    fp8 = _find(_GatedMlp(fmt=SimpleNamespace(name="fp8")))
    assert "down_proj is quantized as" in fp8.skipped["up_proj -> down_proj"] and not fp8.pairs
    assert fp8.quantized_consumers["up_proj -> down_proj"] == ["down_proj"]


def test_a_squared_relu_mlp_has_no_pair():
    finder = _find(_SquaredReluMlp())
    assert not finder.pairs and not finder.skipped
