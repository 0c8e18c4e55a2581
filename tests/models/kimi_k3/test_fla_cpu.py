"""The CPU implementations of fla-core's names (models/kimi_k3/fla_cpu.py) against the reference card's math.

Each op is checked against a by-hand fp64 computation of kimi_k3_reference.md sections 3 and 7 (and the
recurrence also against fla's own chunked reference), plus the call forms the remote code uses: caches,
packed sequences (cu_seqlens), the V-first state layout, and fla's argument checks.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from modelopt_k3.models.kimi_k3 import fla_cpu
from modelopt_k3.models.kimi_k3.fla_cpu import (
    FusedRMSNormGated,
    ShortConvolution,
    chunk_kda,
    fla_reference,
    fused_recurrent_kda,
    install_fla_cpu,
    kda_gate,
    prepare_cu_seqlens_from_mask,
    prepare_lens_from_mask,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------
# ShortConvolution
# ----------------------------------------------------------------------------------------------


def _conv_by_hand(x: torch.Tensor, w: torch.Tensor, prefix: torch.Tensor | None = None) -> torch.Tensor:
    """y[b, t, c] = silu(sum_j w[c, 0, j] * x[b, t - W + 1 + j, c]), zeros (or `prefix`) before t = 0."""
    width = w.shape[-1]
    b, t, c = x.shape
    past = torch.zeros(b, width, c, dtype=torch.float64) if prefix is None else prefix.transpose(1, 2).double()
    full = torch.cat([past, x.double()], dim=1)
    y = torch.zeros(b, t, c, dtype=torch.float64)
    for i in range(t):
        for j in range(width):
            y[:, i] += w[:, 0, j].double() * full[:, i + 1 + j]
    return F.silu(y)


def test_short_convolution_matches_the_card() -> None:
    conv = ShortConvolution(hidden_size=6, kernel_size=4, activation="silu")
    assert conv.weight.shape == (6, 1, 4) and conv.bias is None
    with torch.no_grad():
        conv.weight.normal_(generator=_gen())
    x = torch.randn(2, 7, 6, generator=_gen(1))
    y, state = conv(x=x, output_final_state=True)
    torch.testing.assert_close(y.double(), _conv_by_hand(x, conv.weight), rtol=1e-6, atol=1e-6)
    # The state is the last W inputs, [N, D, W].
    torch.testing.assert_close(state, x[:, -4:].transpose(1, 2))
    assert conv(x=x)[1] is None
    # bf16 in, bf16 out (computed in fp32).
    yb, _ = conv(x=x.bfloat16())
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), y, rtol=2e-2, atol=2e-2)


def test_short_convolution_cache_and_packed_sequences() -> None:
    conv = ShortConvolution(hidden_size=4, kernel_size=3)
    with torch.no_grad():
        conv.weight.normal_(generator=_gen())
    x = torch.randn(2, 9, 4, generator=_gen(1))
    full, _ = conv(x=x)
    # Prefill then one token at a time with the cache = one pass.
    head, cache = conv(x=x[:, :5], output_final_state=True)
    outs = [head]
    for t in range(5, 9):
        y, cache = conv(x=x[:, t : t + 1], cache=cache, output_final_state=True)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-6, atol=1e-6)
    # A short sequence keeps the tail of the incoming cache in its state.
    _, short = conv(x=x[:, :1], cache=cache, output_final_state=True)
    torch.testing.assert_close(short[..., :-1], cache[..., 1:])
    # Packed (cu_seqlens, B = 1): each sequence as if alone, with its own initial state.
    lens = [3, 6]
    packed = torch.cat([x[0, :3], x[1, :6]]).unsqueeze(0)
    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    init = torch.randn(2, 4, 3, generator=_gen(2))
    y, state = conv(x=packed, cache=init, output_final_state=True, cu_seqlens=cu)
    for n, (seq, length) in enumerate(zip((x[0], x[1]), lens)):
        alone, alone_state = conv(x=seq[:length].unsqueeze(0), cache=init[n : n + 1], output_final_state=True)
        torch.testing.assert_close(y[0, cu[n] : cu[n + 1]], alone[0])
        torch.testing.assert_close(state[n], alone_state[0])
    with pytest.raises(ValueError, match="batch size"):
        conv(x=x, cu_seqlens=cu)


# ----------------------------------------------------------------------------------------------
# FusedRMSNormGated
# ----------------------------------------------------------------------------------------------


def test_fused_rms_norm_gated_matches_the_card() -> None:
    norm = FusedRMSNormGated(16, eps=1e-5, activation="sigmoid")
    assert torch.equal(norm.weight, torch.ones(16))
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=_gen())
    x, g = torch.randn(3, 2, 16, generator=_gen(1)), torch.randn(3, 2, 16, generator=_gen(2))
    xd = x.double()
    expected = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double() * torch.sigmoid(g.double())
    torch.testing.assert_close(norm(x, g).double(), expected, rtol=1e-6, atol=1e-6)
    swish = FusedRMSNormGated(16, eps=1e-5, activation="swish")
    swish.load_state_dict(norm.state_dict())
    torch.testing.assert_close(swish(x, g).double(), expected * g.double(), rtol=1e-6, atol=1e-6)
    assert norm(x.bfloat16(), g.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="Unsupported activation"):
        FusedRMSNormGated(16, activation="relu")


# ----------------------------------------------------------------------------------------------
# KDA
# ----------------------------------------------------------------------------------------------


def _kda_inputs(B: int = 2, T: int = 9, H: int = 2, K: int = 8, V: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    g = _gen(seed)
    A_log = torch.zeros(K)  # stored longer than H, as the real checkpoint: only A_log[:H] is read
    A_log[:H] = torch.rand(H, generator=g) * 2
    return {
        "q": torch.randn(B, T, H, K, generator=g),
        "k": torch.randn(B, T, H, K, generator=g),
        "v": torch.randn(B, T, H, V, generator=g),
        "g": torch.randn(B, T, H, K, generator=g),
        "beta": torch.randn(B, T, H, generator=g),
        "A_log": A_log,
        "dt_bias": 0.3 * torch.randn(H * K, generator=g),
    }


def _kda_by_hand(inp: dict[str, torch.Tensor], lower_bound: float | None, state: torch.Tensor | None = None):
    """kimi_k3_reference.md section 3, step 3, in fp64; state [B, H, K, V]."""
    q, k, v, g, beta = (inp[n].double() for n in ("q", "k", "v", "g", "beta"))
    B, T, H, K = q.shape
    q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    z = g + inp["dt_bias"].double().view(H, K)
    a_scale = inp["A_log"][:H].double().exp().view(H, 1)
    a = lower_bound * torch.sigmoid(a_scale * z) if lower_bound is not None else -a_scale * F.softplus(z)
    b = torch.sigmoid(beta)
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64) if state is None else state.double().clone()
    out = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for t in range(T):
        S = S * a[:, t].exp().unsqueeze(-1)
        delta = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + torch.einsum("bhk,bhv->bhkv", b[:, t].unsqueeze(-1) * k[:, t], delta)
        out[:, t] = K**-0.5 * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return out, S


_KERNEL_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["lower-bound-gate", "softplus-gate"])
def test_chunk_kda_matches_the_card(lower_bound: float | None) -> None:
    inp = _kda_inputs()
    o, state = chunk_kda(**inp, **_KERNEL_FLAGS, output_final_state=True, safe_gate=lower_bound is not None, lower_bound=lower_bound)
    want_o, want_s = _kda_by_hand(inp, lower_bound)
    torch.testing.assert_close(o.double(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), want_s, rtol=1e-5, atol=1e-5)
    assert o.dtype == inp["v"].dtype and state.dtype == torch.float32


def test_kda_gate_by_hand_and_reads_only_num_heads_entries() -> None:
    inp = _kda_inputs()
    H, K = inp["g"].shape[-2:]
    z = inp["g"] + inp["dt_bias"].view(H, K)
    lb = kda_gate(inp["g"], inp["A_log"], inp["dt_bias"], -5.0)
    torch.testing.assert_close(lb, -5.0 * torch.sigmoid(inp["A_log"][:H].exp().view(H, 1) * z))
    soft = kda_gate(inp["g"], inp["A_log"][:H], inp["dt_bias"], None)
    torch.testing.assert_close(soft, -inp["A_log"][:H].exp().view(H, 1) * F.softplus(z))
    torch.testing.assert_close(kda_gate(inp["g"], inp["A_log"], inp["dt_bias"], None), soft)


def test_chunk_kda_matches_fla_chunked_reference() -> None:
    """fla's naive_chunk_kda (a chunked formulation, T a multiple of the chunk) agrees with ours."""
    naive = fla_reference("ops/kda/naive.py")
    inp = _kda_inputs(T=32)
    H, K = inp["g"].shape[-2:]
    q, k = fla_cpu.l2norm(inp["q"]), fla_cpu.l2norm(inp["k"])
    gate = kda_gate(inp["g"], inp["A_log"], inp["dt_bias"], -5.0)
    ref_o, ref_s = naive.naive_chunk_kda(q, k, inp["v"], gate, inp["beta"].sigmoid(), output_final_state=True, chunk_size=16)
    o, s = chunk_kda(**inp, **_KERNEL_FLAGS, output_final_state=True, safe_gate=True, lower_bound=-5.0)
    torch.testing.assert_close(o, ref_o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, ref_s, rtol=1e-4, atol=1e-4)


def test_kda_state_layout_continuation_and_packing() -> None:
    inp = _kda_inputs(T=10)
    flags = dict(**_KERNEL_FLAGS, lower_bound=-5.0, output_final_state=True)
    full, full_state = chunk_kda(**inp, safe_gate=True, **flags)
    # transpose_state_layout (fla 0.6's deprecated name of state_v_first): the state is [V, K].
    first = {n: (t[:, :6] if t.dim() > 1 else t) for n, t in inp.items()}
    _, vk_state = chunk_kda(**first, safe_gate=True, transpose_state_layout=True, **flags)
    _, kv_state = chunk_kda(**first, safe_gate=True, **flags)
    torch.testing.assert_close(vk_state, kv_state.transpose(-1, -2))
    # Prefill 6 tokens, then decode one token at a time with fused_recurrent_kda = one pass.
    outs, state = [], vk_state
    for t in range(6, 10):
        step = {n: (v[:, t : t + 1] if v.dim() > 1 else v) for n, v in inp.items()}
        o, state = fused_recurrent_kda(**step, initial_state=state, transpose_state_layout=True, **flags)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=1), full[:, 6:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.transpose(-1, -2), full_state, rtol=1e-5, atol=1e-5)
    # Packed sequences (B = 1, cu_seqlens) = each sequence alone.
    packed = {n: (torch.cat([t[0, :4], t[1, :10]]).unsqueeze(0) if t.dim() > 1 else t) for n, t in inp.items()}
    cu = torch.tensor([0, 4, 14], dtype=torch.int32)
    o, s = chunk_kda(**packed, safe_gate=True, cu_seqlens=cu, **flags)
    alone, alone_s = chunk_kda(**{n: (t[:1, :4] if t.dim() > 1 else t) for n, t in inp.items()}, safe_gate=True, **flags)
    torch.testing.assert_close(o[:, :4], alone)
    torch.testing.assert_close(o[0, 4:], full[1])
    torch.testing.assert_close(s, torch.cat([alone_s, full_state[1:]]))


def test_kda_argument_checks_match_fla() -> None:
    inp = _kda_inputs(T=3)
    with pytest.raises(ValueError, match="safe range"):
        chunk_kda(**inp, **_KERNEL_FLAGS, safe_gate=True, lower_bound=-6.0)
    with pytest.raises(AssertionError, match="float32"):
        chunk_kda(**inp, **_KERNEL_FLAGS, initial_state=torch.zeros(2, 2, 8, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="batch size"):
        chunk_kda(**inp, **_KERNEL_FLAGS, cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(NotImplementedError, match="cp_context"):
        chunk_kda(**inp, **_KERNEL_FLAGS, cp_context=object())


# ----------------------------------------------------------------------------------------------
# Index helpers and installation
# ----------------------------------------------------------------------------------------------


def test_index_helpers() -> None:
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    assert prepare_lens_from_mask(mask).tolist() == [3, 4, 2]
    cu = prepare_cu_seqlens_from_mask(mask)
    assert cu.tolist() == [0, 3, 7, 9] and cu.dtype == torch.int32


def test_installed_only_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(fla_cpu, "triton_available", lambda: True)
    monkeypatch.delenv(fla_cpu.FORCE_ENV, raising=False)
    assert install_fla_cpu() is False
    assert "fla.ops.kda" not in sys.modules  # a GPU machine keeps fla's kernels
    monkeypatch.setattr(fla_cpu, "triton_available", lambda: False)
    assert install_fla_cpu() is True
    from fla.modules import FusedRMSNormGated as installed_norm
    from fla.ops.kda import chunk_kda as installed_kda
    from fla.utils import tensor_cache

    assert installed_kda is chunk_kda and installed_norm is FusedRMSNormGated
    assert tensor_cache(len) is len
    assert fla_cpu.fla_cpu_installed()
