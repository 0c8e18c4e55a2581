"""Bit-level tests of modelopt_k3.numerics against docs/FORMATS.md (and compressed-tensors where it applies)."""

from __future__ import annotations

import math

import pytest
import torch

from modelopt_k3.numerics import (
    E2M1_VALUES,
    FP4_MAX,
    FP8_E4M3_MAX,
    NVFP4Weight,
    e2m1_decode,
    e2m1_round,
    fp8_dequantize_blockwise,
    fp8_dequantize_per_tensor,
    fp8_fake_quant_blockwise,
    fp8_fake_quant_per_tensor,
    fp8_quantize_blockwise,
    fp8_quantize_per_tensor,
    fp8_scale,
    mxfp4_decode,
    mxfp4_encode,
    mxfp4_to_nvfp4,
    nvfp4_block_scales,
    nvfp4_dequantize,
    nvfp4_fake_quant,
    nvfp4_global_scale,
    nvfp4_quantize,
    pack_fp4,
    shared_global_scale_for,
    unpack_fp4,
)

E4M3 = torch.float8_e4m3fn
FORMATS_VALUES = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
THRESHOLDS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view for exact comparisons (distinguishes -0.0 and NaN payloads)."""
    return t.contiguous().view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, msg: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{msg}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    )
    diff = (bits(a) != bits(b)).nonzero()
    assert diff.numel() == 0, (
        f"{msg}: {diff.shape[0]} mismatches, first at {diff[0].tolist()}: {a[tuple(diff[0])]} vs {b[tuple(diff[0])]}"
    )


def threshold_rule(x: torch.Tensor) -> torch.Tensor:
    """FORMATS.md rule, evaluated in float64 (exact for every fp32/bf16/fp16 input); sign bit kept, NaN -> ±6."""
    mag = x.double().abs()
    code = torch.zeros(x.shape, dtype=torch.int64)
    for t in THRESHOLDS:
        code += mag > t
    code += (mag == 0.75) | (mag == 1.75) | (mag == 3.5)
    code[torch.isnan(mag)] = 7
    return (code | (torch.signbit(x).long() << 3)).to(torch.uint8)


# ----------------------------------------------------------------------------------------- E2M1


def test_e2m1_values_and_decode_all_codes():
    assert list(E2M1_VALUES) == FORMATS_VALUES
    assert [math.copysign(1, v) for v in E2M1_VALUES] == [1] * 8 + [-1] * 8
    codes = torch.arange(16, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        expected = torch.tensor(FORMATS_VALUES, dtype=dtype)
        assert_bits_equal(e2m1_decode(codes, dtype), expected, str(dtype))
    assert_bits_equal(e2m1_round(torch.tensor(FORMATS_VALUES)), codes, "round(decode(c)) == c")


def test_e2m1_round_midpoints_and_specials():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    expected = torch.tensor([0, 2, 2, 4, 4, 6, 6], dtype=torch.uint8)  # ties to the even code
    assert_bits_equal(e2m1_round(x), expected, "midpoints")
    assert_bits_equal(e2m1_round(-x), expected | 8, "negative midpoints")
    inf, nan = float("inf"), float("nan")
    specials = torch.tensor([0.0, -0.0, 1e-30, -1e-30, -0.25, 6.0, 6.5, 1e30, inf, -inf, nan, -nan])
    expected = torch.tensor([0, 8, 0, 8, 8, 7, 7, 7, 7, 15, 7, 15], dtype=torch.uint8)
    assert_bits_equal(e2m1_round(specials), expected, "specials")
    # float64 inputs are rounded from their own value (no double rounding through fp32)
    x64 = torch.tensor([0.25 + 1e-12, 0.75 - 1e-12, 5.0 + 1e-12, -(2.5 + 1e-13)], dtype=torch.float64)
    assert e2m1_round(x64).tolist() == [1, 1, 7, 13]


def test_e2m1_round_dense_sweep_fp32():
    grid = torch.tensor(THRESHOLDS + [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 2.0**-126, 2.0**-149])
    centre = grid.view(torch.int32)
    offsets = torch.arange(-64, 65, dtype=torch.int32)
    near = (centre[:, None] + offsets[None, :]).reshape(-1).view(torch.float32)  # +-64 ulps around each point
    dense = torch.linspace(-8, 8, 400_001)
    g = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (400_000,), generator=g, dtype=torch.int64)
    random_bits = random_bits.to(torch.int32).view(torch.float32)
    canonical = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf")])
    x = torch.cat([near, -near, dense, random_bits, canonical])
    x = x[~torch.isnan(x) | (bits(x) & 0x7FFFFFFF == 0x7FC00000)]  # canonical NaNs only in this sweep
    assert_bits_equal(e2m1_round(x), threshold_rule(x), "fp32 sweep")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_e2m1_round_exhaustive_16bit(dtype):
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    assert_bits_equal(e2m1_round(x), threshold_rule(x), str(dtype))


def test_e2m1_round_any_nan_payload_saturates():
    payloads = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7FE00000, -1, -(2**22)], dtype=torch.int32)
    x = payloads.view(torch.float32)
    assert torch.isnan(x).all()
    assert e2m1_round(x).tolist() == [7, 7, 7, 7, 15, 15]


def test_pack_unpack_nibble_order():
    codes = torch.tensor([[0x1, 0x2, 0x3, 0xF]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0xF3]]  # element 2i in the low nibble
    assert unpack_fp4(torch.tensor([0x21, 0xF3], dtype=torch.uint8)).tolist() == [1, 2, 3, 15]
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 5, 32), generator=g, dtype=torch.uint8)
    assert_bits_equal(unpack_fp4(pack_fp4(codes)), codes, "round trip")
    with pytest.raises(ValueError):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------- MXFP4


def _ct_mxfp4_decode(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' own decoder: MXFP4PackedCompressor.decompress (bf16), or its pieces in fp32."""
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    args = QuantizationArgs(
        num_bits=4,
        type="float",
        strategy="group",
        group_size=32,
        symmetric=True,
        dynamic=False,
        scale_dtype=torch.uint8,
    )
    if dtype == torch.bfloat16:
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        return MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, scheme)[
            "weight"
        ]
    m, n = packed.shape
    unpacked = unpack_fp4_from_uint8(packed, m, n * 2, dtype=dtype)
    return dequantize(x_q=unpacked, scale=decompress_mx_scale(scale).to(dtype), args=args, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_decode_matches_compressed_tensors(dtype):
    pytest.importorskip("compressed_tensors")
    g = torch.Generator().manual_seed(2)
    out, n = 255, 256
    packed = torch.randint(0, 256, (out, n // 2), generator=g, dtype=torch.uint8)
    # every exponent 0..254 appears (255 is E8M0 NaN: we decode NaN, compressed-tensors inf; see below)
    scale = torch.randint(0, 255, (out, n // 32), generator=g, dtype=torch.uint8)
    scale[:, 0] = torch.arange(255, dtype=torch.uint8)
    ours = mxfp4_decode(packed, scale, dtype)
    assert_bits_equal(ours, _ct_mxfp4_decode(packed, scale, dtype), f"mxfp4 {dtype}")
    assert torch.isinf(ours).any() and (ours[ours != 0].abs().min() == 2.0**-128)  # extremes were exercised


def test_mxfp4_decode_nan_scale_and_batched():
    packed = torch.tensor([[0x21] * 16], dtype=torch.uint8)
    scale = torch.tensor([[255]], dtype=torch.uint8)
    assert torch.isnan(mxfp4_decode(packed, scale, torch.float32)).all()
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (3, 8, 32), generator=g, dtype=torch.uint8)
    scale = torch.randint(100, 150, (3, 8, 2), generator=g, dtype=torch.uint8)
    batched = mxfp4_decode(packed, scale)
    assert batched.shape == (3, 8, 64) and batched.dtype == torch.bfloat16
    for e in range(3):
        assert_bits_equal(batched[e], mxfp4_decode(packed[e], scale[e]), f"expert {e}")
    with pytest.raises(ValueError):
        mxfp4_decode(packed, scale[..., :1])


def test_mxfp4_encode_ocp_rule():
    w = torch.zeros(1, 128)
    w[0, 0], w[0, 1], w[0, 2] = 5.0, -2.6, 0.3  # block 0: amax 5 -> floor(log2 5) - 2 = 0 -> byte 127
    w[0, 32] = 8.0  # block 1: amax 8 -> e = 1
    w[0, 64], w[0, 65] = 7.9, 1.0  # block 2: amax 7.9 -> e = 0, 7.9 saturates to 6
    packed, scale = mxfp4_encode(w)  # block 3: all zero -> byte 0
    assert scale.tolist() == [[127, 128, 127, 0]]
    codes = unpack_fp4(packed)
    assert codes[0, :3].tolist() == [6, 13, 1]  # 5 -> 4 (tie to even), -2.6 -> -3, 0.3 -> 0.5
    assert codes[0, 32] == 6 and codes[0, 64:66].tolist() == [7, 2]
    assert not codes[0, 96:].any()
    g = torch.Generator().manual_seed(4)
    w = torch.randn(16, 256, generator=g) * torch.logspace(-3, 3, 16)[:, None]
    packed, scale = mxfp4_encode(w)
    err = (mxfp4_decode(packed, scale, torch.float32) - w).abs()
    step = 2.0 ** (
        scale.float() - 127
    )  # 2**e; the coarsest E2M1 gap is 2 * 2**e, saturation loses < 2 * 2**e
    assert (err <= step.repeat_interleave(32, dim=-1) * 2).all()


# ---------------------------------------------------------------------------------------- NVFP4


def test_nvfp4_hand_computed_example():
    w = torch.zeros(1, 64)
    # block 0: holds the tensor amax 1344 -> weight_scale_2 = 1344 / 2688 = 0.5; block scale 1344 / 3 = 448
    w[0, 0:5] = torch.tensor([1344.0, 56.0, 168.0, -560.0, -1.0])  # / 224 = 6, .25, .75, -2.5, -0.0045
    # block 1: all zero -> block scale 1.0
    # block 2: amax 0.0006 -> 0.0002 < 2**-9 -> clamped to 2**-9, eff = 2**-10; 0.0006 * 1024 = 0.6144 -> 0.5
    w[0, 32] = 0.0006
    # block 3: amax 15.9 -> 15.9 / 3 = 5.3 -> e4m3 rounds to 5.5; eff = 2.75; 15.9 / 2.75 = 5.78 -> 6; 3.4375 / 2.75 = 1.25 -> 1
    w[0, 48], w[0, 49] = 15.9, 3.4375
    gs = nvfp4_global_scale(w.abs().amax())
    assert gs.dtype == torch.float32 and gs.shape == () and gs.item() == 0.5
    q = nvfp4_quantize(w)
    assert isinstance(q, NVFP4Weight) and q.global_scale.item() == 0.5 and q.global_scale.shape == ()
    assert q.block_scale.dtype == E4M3 and q.block_scale.float().tolist() == [[448.0, 1.0, 2.0**-9, 5.5]]
    assert_bits_equal(q.block_scale, nvfp4_block_scales(w, gs), "nvfp4_block_scales")
    codes = unpack_fp4(q.packed)[0]
    assert codes[0:5].tolist() == [7, 0, 2, 12, 8]
    assert q.packed[0, 0:3].tolist() == [0x07, 0xC2, 0x08]
    assert not codes[5:32].any() and codes[32] == 1 and not codes[33:48].any()
    assert codes[48:50].tolist() == [7, 2]
    deq = nvfp4_dequantize(*q)
    assert deq[0, [0, 2, 3, 32, 48, 49]].tolist() == [1344.0, 224.0, -448.0, 2.0**-11, 16.5, 2.75]
    assert nvfp4_global_scale(torch.tensor(0.0)).item() == 1.0  # documented choice for amax == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nvfp4_negative_zero_is_code_plus_zero_as_modelopt_writes_it(dtype):
    """ModelOpt's NVFP4 export takes the sign bit from ``x < 0``: an exact -0.0 (a block-FP8 source's E4M3 0x80)
    is code 0, a negative that rounds to zero magnitude stays code 8 (e2m1_round gives 8 to both); fake quant
    agrees with dequantize(quantize) bit for bit (+0.0 and -0.0)."""
    w = torch.zeros(2, 32, dtype=dtype)
    w[0, 0], w[0, 1], w[0, 2] = 6.0, -0.0, -0.01  # eff = 448 * 6 / 2688 = 1
    w[1, :16] = -0.0  # an all-(-0) block: scale 1.0, codes +0
    w[1, 16], w[1, 17] = 3.0, -0.0
    q = nvfp4_quantize(w)
    codes = unpack_fp4(q.packed)
    assert codes[0, :3].tolist() == [7, 0, 8] and not codes[0, 3:].any()
    assert not codes[1, :16].any() and codes[1, 16:18].tolist() == [7, 0]
    assert e2m1_round(torch.tensor([-0.0, -0.01])).tolist() == [8, 8]
    fq = nvfp4_fake_quant(w, q.global_scale)
    assert_bits_equal(fq, nvfp4_dequantize(*q, dtype=dtype), "fake quant")
    assert [math.copysign(1, v) for v in fq[0, 1:3].float().tolist()] == [1, -1]


def test_nvfp4_block_scale_clamps():
    gs = torch.tensor(1.0)
    w = torch.zeros(3, 16)
    w[0, 0] = 6 * 1000.0  # 1000 -> clamped to 448
    w[1, 0] = 6 * 2.0**-12  # 2**-12 -> clamped up to 2**-9
    w[2, 0] = 6 * 17.0  # 17 -> RNE in e4m3 (16, 18) -> 16
    assert nvfp4_block_scales(w, gs).float().view(-1).tolist() == [448.0, 2.0**-9, 16.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nvfp4_round_trip_error_and_fake_quant_exact(dtype):
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(64, 512, generator=g) * torch.logspace(-2, 2, 64)[:, None]).to(dtype)
    w[3, 16:32] = 0  # an all-zero block
    q = nvfp4_quantize(w)
    deq = nvfp4_dequantize(*q, dtype=torch.float32)
    eff = (q.block_scale.float() * q.global_scale).repeat_interleave(16, dim=-1)
    # half the widest E2M1 gap (2) is one eff; the e4m3 block scale may round down by < 1/16 (saturation)
    assert ((deq - w.float()).abs() <= eff * (1 + 1e-6)).all()
    sqnr = 10 * torch.log10(w.float().pow(2).sum() / (deq - w.float()).pow(2).sum())
    assert sqnr > 17, f"SQNR {sqnr:.1f} dB too low for {dtype}"
    fq = nvfp4_fake_quant(w, q.global_scale)
    assert fq.dtype == dtype
    assert_bits_equal(fq, nvfp4_dequantize(*q, dtype=dtype), f"fake quant {dtype}")
    # activations: any leading shape, static global scale, dynamic block scales
    x = torch.randn(2, 3, 5, 64, generator=g).to(dtype)
    gs_in = nvfp4_global_scale(torch.tensor(3.0))
    qx = nvfp4_quantize(x, gs_in)
    assert qx.packed.shape == (2, 3, 5, 32) and qx.block_scale.shape == (2, 3, 5, 4)
    assert_bits_equal(nvfp4_fake_quant(x, gs_in), nvfp4_dequantize(*qx, dtype=dtype), "activation fake quant")


def test_nvfp4_nan_block_dequantizes_to_nan():
    w = torch.linspace(-1, 1, 64).view(2, 32)
    w[0, 3] = float("nan")
    q = nvfp4_quantize(w, torch.tensor(1.0))
    deq = nvfp4_dequantize(*q)
    assert (
        torch.isnan(deq[0, :16]).all()
        and not torch.isnan(deq[0, 16:]).any()
        and not torch.isnan(deq[1]).any()
    )
    assert torch.isnan(nvfp4_fake_quant(w, 1.0)[0, :16]).all()
    assert (q.packed[0, :8] == 0x77).all() and not (q.packed[0, 8:] == 0x77).any()  # fixed codes: +6
    packed, scale = mxfp4_encode(w)
    assert scale[:, 0].tolist() == [255, 125] and (packed[0] == 0x77).all() and not (packed[1] == 0x77).all()


def test_nvfp4_per_expert_global_scales_match_loop():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(4, 24, 64, generator=g) * torch.tensor([0.01, 1.0, 30.0, 500.0])[:, None, None]
    gs = nvfp4_global_scale(w.abs().amax(dim=(-2, -1)))
    default = nvfp4_quantize(w)
    assert_bits_equal(default.global_scale, gs, "default per-expert global scale")
    for gs_arg in (gs, gs.view(4, 1, 1)):
        q = nvfp4_quantize(w, gs_arg)
        fq = nvfp4_fake_quant(w, gs_arg)
        deq = nvfp4_dequantize(*q)
        for e in range(4):
            qe = nvfp4_quantize(w[e], gs[e])
            assert_bits_equal(q.packed[e], qe.packed, f"packed e={e}")
            assert_bits_equal(q.block_scale[e], qe.block_scale, f"block scale e={e}")
            assert_bits_equal(default.packed[e], qe.packed, f"default packed e={e}")
            assert_bits_equal(fq[e], nvfp4_fake_quant(w[e], gs[e]), f"fake quant e={e}")
            assert_bits_equal(deq[e], nvfp4_dequantize(*qe), f"dequant e={e}")
    with pytest.raises(ValueError):
        nvfp4_quantize(w, torch.ones(3))


def _ct_nvfp4(w: torch.Tensor):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = QuantizationArgs(
        num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True, scale_dtype=E4M3
    )
    amax = w.abs().amax().float()
    gs_ct = generate_gparam(-amax, amax)
    wb = w.float().view(w.shape[0], -1, 16)
    ct_scale, _ = calculate_qparams(wb.amin(-1), wb.amax(-1), args, global_scale=gs_ct)
    ct = NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": ct_scale, "weight_global_scale": gs_ct},
        QuantizationScheme(targets=["Linear"], weights=args),
    )
    return ct["weight_packed"], ct["weight_scale"], gs_ct


def test_nvfp4_against_compressed_tensors():
    """compressed-tensors' NVFP4 (reciprocal global scale, FORMATS.md) against ours.

    Same definition up to fp32 rounding order, and two deliberate differences:
    - CT: scale = e4m3(gs_ct * block_amax / 6), gs_ct = 2688 / amax, codes = round(w / (scale / gs_ct)).
      Ours (ModelOpt's order, FORMATS.md): scale = e4m3(block_amax / (6 * ws2)), ws2 = amax / 2688,
      codes = round(w / (scale * ws2)). bf16 weights often land exactly on an e4m3 or E2M1 midpoint,
      where the last-ulp difference decides the tie: those blocks differ by one step. fp32 weights agree.
    - CT gives an all-zero block the scale 0.125 (its fp8 "eps"); FORMATS.md (and ModelOpt) say 1.0.
    - CT does not clamp small block scales at 2**-9 (the cast may flush them to 0, then 0.125).
    """
    pytest.importorskip("compressed_tensors")
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(128, 1024, generator=g) * torch.logspace(-1, 1, 128)[:, None]).to(dtype)
        w[5, 32:48] = 0
        ct_packed, ct_bs, gs_ct = _ct_nvfp4(w)
        ours = nvfp4_quantize(w)
        assert torch.allclose(1 / gs_ct, ours.global_scale, rtol=2**-22, atol=0)
        assert ct_bs[5, 2].float() == 0.125 and ours.block_scale[5, 2].float() == 1.0
        ct_bs[5, 2] = ours.block_scale[5, 2]
        step = (bits(ct_bs).int() - bits(ours.block_scale).int()).abs()
        code_diff = (unpack_fp4(ct_packed) != unpack_fp4(ours.packed)).float().mean().item()
        if dtype == torch.float32:
            assert step.max() == 0 and code_diff == 0
        else:
            assert step.max() <= 1 and step.float().mean() < 0.02, step.float().mean()
            assert code_diff < 0.01, code_diff


# ------------------------------------------------------------------------------------------ FP8


def test_fp8_per_tensor():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(64, 96, generator=g).to(torch.bfloat16) * 3
    q, s = fp8_quantize_per_tensor(w)
    assert q.dtype == E4M3 and s.dtype == torch.float32 and s.shape == ()
    assert s == w.abs().amax().float() / 448
    assert_bits_equal(q, (w.float() / s).clamp(-448, 448).to(E4M3), "per-tensor codes")
    deq = fp8_dequantize_per_tensor(q, s)
    assert ((deq - w.float()).abs() <= w.float().abs() * 2.0**-4 + s * 2.0**-10).all()
    assert_bits_equal(fp8_fake_quant_per_tensor(w, s), deq.to(torch.bfloat16), "fake quant")
    q2, s2 = fp8_quantize_per_tensor(w, torch.tensor([0.001]))  # given scale saturates at 448
    assert s2.shape == () and q2.float().abs().max() == 448
    assert fp8_scale(torch.tensor(0.0)).item() == 1.0 and fp8_scale(torch.tensor(896.0)).item() == 2.0
    assert torch.isnan(fp8_quantize_per_tensor(torch.tensor([float("nan"), 1.0]), 1.0)[0].float()[0])


@pytest.mark.parametrize("shape", [(256, 384), (96, 200), (2, 130, 129)])
def test_fp8_blockwise(shape):
    g = torch.Generator().manual_seed(9)
    w = torch.randn(*shape, generator=g) * 2
    if len(shape) == 2 and shape[0] == 256:
        w[128:, 128:256] = 0  # an all-zero block -> scale 1.0
    q, s = fp8_quantize_blockwise(w)
    rows, cols = shape[-2:]
    assert q.shape == w.shape and q.dtype == E4M3
    assert s.shape == (*shape[:-2], math.ceil(rows / 128), math.ceil(cols / 128)) and s.dtype == torch.float32
    w3, q3, s3 = w.reshape(-1, rows, cols), q.reshape(-1, rows, cols), s.reshape(-1, *s.shape[-2:])
    for b in range(w3.shape[0]):
        for i in range(s3.shape[1]):
            for j in range(s3.shape[2]):
                blk = w3[b, i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]  # partial at the edges
                amax = blk.abs().amax()
                expected = amax / 448 if amax > 0 else torch.tensor(1.0)
                assert s3[b, i, j] == expected, (b, i, j)
                qb = q3[b, i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
                assert_bits_equal(qb, (blk / expected).clamp(-448, 448).to(E4M3), f"block {(b, i, j)}")
    if len(shape) == 2 and shape[0] == 256:
        assert s[1, 1] == 1.0
    deq = fp8_dequantize_blockwise(q, s)
    full = s.repeat_interleave(128, -2)[..., :rows, :].repeat_interleave(128, -1)[..., :cols]
    assert ((deq - w).abs() <= w.abs() * 2.0**-4 + full * 2.0**-10).all()
    assert_bits_equal(fp8_fake_quant_blockwise(w), deq, "blockwise fake quant")


# --------------------------------------------------------------------------------- MXFP4 -> NVFP4


def _random_mxfp4(shape, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    *lead, out, n = shape
    packed = torch.randint(0, 256, (*lead, out, n // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(lo, hi + 1, (*lead, out, n // 32), generator=g, dtype=torch.uint8)
    return packed, scale


def test_mxfp4_to_nvfp4_lossless_when_exponents_fit():
    packed, scale = _random_mxfp4((64, 256), 110, 127, seed=10)  # 18 exponents: the lossless window
    scale[0, 0], scale[0, 1] = 110, 127
    res, n_req = mxfp4_to_nvfp4(packed, scale)
    assert n_req == 0
    assert res.global_scale.item() == 2.0 ** (127 - 127 - 8)  # the largest block scale maps to 2**8
    assert_bits_equal(res.packed, packed, "codes carry over byte for byte")
    assert res.block_scale.dtype == E4M3 and res.block_scale.shape == (64, 16)
    assert_bits_equal(
        res.block_scale.float(), 2.0 ** (scale.float() - 127 + 8).repeat_interleave(2, -1), "scales"
    )
    for dtype in (torch.float32, torch.bfloat16):
        assert_bits_equal(
            nvfp4_dequantize(*res, dtype=dtype), mxfp4_decode(packed, scale, dtype), f"lossless {dtype}"
        )


def test_mxfp4_to_nvfp4_requantizes_and_counts_out_of_range_blocks():
    packed, scale = _random_mxfp4((32, 512), 95, 130, seed=11)
    packed.view(32, 32, 8)[0, 3] = 0x88  # a -0/-0 half block with a tiny exponent: carried, not counted
    scale[0, 1], scale[1, 0] = 95, 130
    res, n_req = mxfp4_to_nvfp4(packed, scale)
    gs = res.global_scale
    assert gs.item() == 2.0 ** (130 - 135)
    low = (scale < 130 - 17).repeat_interleave(2, -1)  # below 2**-9 relative to gs
    zero = (packed.view(32, 32, 8) & 0x77).amax(-1) == 0
    assert zero[0, 3] and low[0, 3]
    assert n_req == int((low & ~zero).sum()) > 0
    assert res.block_scale[0, 3].float() == 1.0
    decoded = mxfp4_decode(packed, scale, torch.float32)
    expect = nvfp4_quantize(decoded, gs)  # the same NVFP4 numerics with the same global scale
    req = low & ~zero
    assert_bits_equal(res.block_scale[req], expect.block_scale[req], "requantized block scales")
    assert_bits_equal(
        res.packed.view(32, 32, 8)[req], expect.packed.view(32, 32, 8)[req], "requantized codes"
    )
    ok = ~low
    assert_bits_equal(res.packed.view(32, 32, 8)[ok], packed.view(32, 32, 8)[ok], "carried codes")
    deq = nvfp4_dequantize(*res).view(32, 32, 16)
    assert_bits_equal(deq[ok], decoded.view(32, 32, 16)[ok], "carried blocks decode exactly")
    # a non-power-of-two global scale carries nothing but all-zero blocks
    _, n_all = mxfp4_to_nvfp4(packed, scale, gs * 1.5)
    assert n_all == int((~zero).sum())


def test_mxfp4_to_nvfp4_nan_scale_is_requantized_to_nan():
    packed, scale = _random_mxfp4((4, 64), 120, 126, seed=12)
    packed[0, :16] = 0x11
    scale[0, 0], scale[1, 0] = 255, 126
    res, n_req = mxfp4_to_nvfp4(packed, scale)
    assert n_req == 2 and res.global_scale.item() == 2.0 ** (126 - 135)
    deq = nvfp4_dequantize(*res)
    assert torch.isnan(deq[0, :32]).all() and not torch.isnan(deq[:, 32:]).any()
    assert (res.packed[0, :16] == 0x77).all() and torch.isnan(res.block_scale[0, :2].float()).all()


@pytest.mark.parametrize("case", ["carried", "shifted", "requantized"])
def test_share_codes_gives_the_same_bytes_and_aliases_only_when_every_code_carries(case):
    """``share_codes`` (the converter's) returns the source codes themselves only when every byte carries
    over; otherwise the carried slabs are copied after the fact: bytes equal to the default either way."""
    packed, scale = _random_mxfp4((1024, 1024), 110, 127, seed=21)  # 512 KiB of codes: several slabs
    scale[0, 0] = 127
    if case == "shifted":
        scale[-1, 3] = 100  # below the lossless window in the last slab: its codes are shifted
    elif case == "requantized":
        scale[5, 1] = 255  # E8M0 NaN: requantized from its decoded values
    expect, n_expect = mxfp4_to_nvfp4(packed, scale)
    got, n_got = mxfp4_to_nvfp4(packed, scale, share_codes=True)
    assert n_got == n_expect and (n_got == 0) == (case == "carried")
    assert_bits_equal(got.packed, expect.packed, "codes")
    assert_bits_equal(got.block_scale, expect.block_scale, "block scales")
    assert_bits_equal(got.global_scale, expect.global_scale, "global scale")
    assert (got.packed.data_ptr() == packed.data_ptr()) == (case == "carried")
    assert expect.packed.data_ptr() != packed.data_ptr()  # the default always copies


def test_shared_global_scale_for_ignores_nan_bytes_per_leading_index():
    _, s = _random_mxfp4((2, 64, 256), 100, 120, seed=22)
    s[0, 3, 1], s[1, 0, 0], s[1, 7, 2] = 255, 124, 255
    got = shared_global_scale_for(s)
    assert got.tolist() == [2.0 ** (120 - 135), 2.0 ** (124 - 135)]
    assert shared_global_scale_for(s[0]).item() == 2.0 ** (120 - 135)


def test_shared_global_scale_for_w1_w3_and_batched_experts():
    p1, s1 = _random_mxfp4((3, 16, 128), 105, 120, seed=13)
    p3, s3 = _random_mxfp4((3, 16, 128), 108, 125, seed=14)
    s1[1] = s1[1].clamp(max=118)
    s3[1] = s3[1].clamp(max=112)
    s1[0, 0, 0], s1[1, 0, 0], s3[0, 0, 0], s3[2, 0, 0] = 105, 118, 125, 125
    shared = shared_global_scale_for(s1, s3)
    assert shared.shape == (3,) and shared.tolist() == [
        2.0 ** (125 - 135),
        2.0 ** (118 - 135),
        2.0 ** (125 - 135),
    ]
    assert shared_global_scale_for(s1[0]).shape == ()
    r1, n1 = mxfp4_to_nvfp4(p1, s1, shared)
    r3, n3 = mxfp4_to_nvfp4(p3, s3, shared)
    assert_bits_equal(r1.global_scale, r3.global_scale, "w1/w3 share weight_scale_2")
    for e in range(3):
        e1, k1 = mxfp4_to_nvfp4(p1[e], s1[e], shared[e])
        assert_bits_equal(r1.packed[e], e1.packed, f"batched packed e={e}")
        assert_bits_equal(r1.block_scale[e], e1.block_scale, f"batched scales e={e}")
    assert n1 == sum(mxfp4_to_nvfp4(p1[e], s1[e], shared[e])[1] for e in range(3))
    # w1 never spans more than 17 exponents below the shared max here except expert 0 (105 < 125 - 17)
    assert n1 > 0 and n3 == 0
    default, _ = mxfp4_to_nvfp4(p1, s1)
    assert_bits_equal(default.global_scale, shared_global_scale_for(s1), "default = own shared scale")
    assert_bits_equal(
        nvfp4_dequantize(*mxfp4_to_nvfp4(p3, s3, shared)[0], dtype=torch.bfloat16),
        mxfp4_decode(p3, s3),
        "w3 lossless under the shared scale",
    )
    assert FP4_MAX == 6.0 and FP8_E4M3_MAX == 448.0


# ------------------------------------------------------------------------------- CPU worker pool


def test_cpu_slab_workers_are_exact_and_leave_thread_settings_alone():
    import threading

    from modelopt_k3.numerics import _slabs

    g = torch.Generator().manual_seed(15)
    w = torch.randn(2, 200, 2048, generator=g).to(torch.bfloat16)  # several slabs
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = nvfp4_quantize(w)
        serial_fq = nvfp4_fake_quant(w, serial.global_scale)
        torch.set_num_threads(2)
        pooled = nvfp4_quantize(w)
        assert_bits_equal(pooled.packed, serial.packed, "packed, 2 workers vs 1 thread")
        assert_bits_equal(pooled.block_scale, serial.block_scale, "block scales, 2 workers vs 1 thread")
        assert_bits_equal(nvfp4_fake_quant(w, serial.global_scale), serial_fq, "fake quant, 2 workers vs 1")
        assert torch.get_num_threads() == 2  # the caller's setting is untouched
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert seen == [2]  # ... and so is the process-wide value new threads start from
        workers = _slabs._pool(2)
        assert {workers.submit(torch.get_num_threads).result() for _ in range(4)} == {1}
    finally:
        torch.set_num_threads(before)
