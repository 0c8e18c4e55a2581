"""The numerics are device-agnostic: on CUDA they must give the CPU bytes exactly (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from modelopt_k3 import numerics as nx

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def _same(cpu, cuda, what: str) -> None:
    if isinstance(cpu, (tuple, list)):
        assert len(cpu) == len(cuda), what
        for i, (a, b) in enumerate(zip(cpu, cuda)):
            _same(a, b, f"{what}[{i}]")
        return
    if not isinstance(cpu, torch.Tensor):
        assert cpu == cuda, what
        return
    b = cuda.cpu()
    assert cpu.dtype == b.dtype and cpu.shape == b.shape, what
    differ = _bits(cpu) != _bits(b)
    if cpu.is_floating_point():  # NaN payloads are not specified: any NaN equals any NaN
        differ &= ~(torch.isnan(cpu.float()) & torch.isnan(b.float()))
    mismatch = differ.sum().item()
    assert mismatch == 0, f"{what}: {mismatch} elements differ between CPU and CUDA"


def _both(fn, *args, **kwargs):
    cpu = fn(*args, **kwargs)
    cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    cuda_kwargs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return cpu, fn(*cuda_args, **cuda_kwargs)


def test_e2m1_cuda_matches_cpu():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    _same(*_both(nx.e2m1_round, x.view(torch.float32)), "e2m1_round fp32 bits")
    bf = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    _same(*_both(nx.e2m1_round, bf), "e2m1_round bf16 exhaustive")
    codes = torch.randint(0, 16, (64, 256), generator=g, dtype=torch.uint8)
    _same(*_both(nx.e2m1_decode, codes, torch.bfloat16), "e2m1_decode")
    _same(*_both(nx.pack_fp4, codes), "pack_fp4")
    _same(*_both(nx.unpack_fp4, nx.pack_fp4(codes)), "unpack_fp4")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_cuda_matches_cpu(dtype):
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (3, 96, 128), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, 256, (3, 96, 8), generator=g, dtype=torch.uint8)
    _same(*_both(nx.mxfp4_decode, packed, scale, dtype), "mxfp4_decode")
    w = torch.randn(96, 512, generator=g).to(dtype) * 10
    _same(*_both(nx.mxfp4_encode, w), "mxfp4_encode")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_nvfp4_cuda_matches_cpu(dtype):
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(4, 96, 256, generator=g) * torch.tensor([1e-3, 1.0, 10.0, 300.0]).view(4, 1, 1)).to(
        dtype
    )
    w[1, 3, :16] = 0
    w[2, 5, 7] = float("nan")
    gs = nx.nvfp4_global_scale(w.float().abs().amax(dim=(-2, -1)))
    _same(*_both(nx.nvfp4_quantize, w), "nvfp4_quantize default")
    _same(*_both(nx.nvfp4_quantize, w, gs), "nvfp4_quantize [E]")
    _same(*_both(nx.nvfp4_quantize, w[0], gs[0]), "nvfp4_quantize 2-D")
    _same(*_both(nx.nvfp4_block_scales, w, gs.view(4, 1, 1)), "nvfp4_block_scales")
    q = nx.nvfp4_quantize(w, gs)
    _same(*_both(nx.nvfp4_dequantize, q.packed, q.block_scale, q.global_scale, dtype), "nvfp4_dequantize")
    _same(*_both(nx.nvfp4_fake_quant, w, gs), "nvfp4_fake_quant weights")
    x = torch.randn(2, 7, 512, generator=g).to(dtype)
    _same(*_both(nx.nvfp4_fake_quant, x, torch.tensor(0.01)), "nvfp4_fake_quant activations")


def test_fp8_cuda_matches_cpu():
    g = torch.Generator().manual_seed(3)
    for shape in [(256, 384), (96, 200)]:
        w = torch.randn(*shape, generator=g).to(torch.bfloat16)
        _same(*_both(nx.fp8_quantize_blockwise, w), f"fp8_quantize_blockwise {shape}")
        _same(*_both(nx.fp8_fake_quant_blockwise, w), f"fp8_fake_quant_blockwise {shape}")
        _same(*_both(nx.fp8_quantize_per_tensor, w), f"fp8_quantize_per_tensor {shape}")
        _same(
            *_both(nx.fp8_fake_quant_per_tensor, w, torch.tensor(0.01)), f"fp8_fake_quant_per_tensor {shape}"
        )


def test_mxfp4_to_nvfp4_cuda_matches_cpu():
    g = torch.Generator().manual_seed(4)
    packed = torch.randint(0, 256, (2, 64, 256), generator=g, dtype=torch.uint8)
    scale = torch.randint(95, 131, (2, 64, 16), generator=g, dtype=torch.uint8)
    scale[0, 0, 0] = 255
    packed[1, 2, :8] = 0x88
    _same(*_both(nx.shared_global_scale_for, scale), "shared_global_scale_for")
    _same(*_both(nx.mxfp4_to_nvfp4, packed, scale), "mxfp4_to_nvfp4 default")
    gs = nx.shared_global_scale_for(scale) * 1.5
    _same(*_both(nx.mxfp4_to_nvfp4, packed, scale, gs), "mxfp4_to_nvfp4 non power of two")
