"""The block-FP8 and INT4 pack-quantized source decoders, bit for bit against transformers' and
compressed-tensors' own, and against an independent block-by-block reference where transformers' is wrong."""

from __future__ import annotations

import pytest
import torch

from modelopt_k3.numerics.block_fp8 import block_fp8_decode, block_fp8_scale_shape
from modelopt_k3.numerics.int4_packed import int4_pack, int4_packed_decode, int4_unpack


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _fp8_case(shape, block=(128, 128), seed=0, scale_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # Every finite E4M3 byte (NaN codes 0x7F/0xFF excluded), scales over a wide range.
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.int16)
    codes = torch.where((codes & 0x7F) == 0x7F, 0, codes).to(torch.uint8)
    weight = codes.view(torch.float8_e4m3fn)
    scale = torch.exp2(torch.randn(block_fp8_scale_shape(shape, block), generator=g) * 4) * torch.rand(1, generator=g)
    return weight, scale.to(scale_dtype)


def _reference(weight, scale, block, dtype):
    """Block by block, each block's scale applied to its own slice (partial blocks at the ends)."""
    bm, bn = block
    out = torch.empty(weight.shape, dtype=dtype)
    rows, cols = weight.shape[-2:]
    for i in range(0, rows, bm):
        for j in range(0, cols, bn):
            s = scale[..., i // bm, j // bn].float()[..., None, None]
            out[..., i : i + bm, j : j + bn] = (weight[..., i : i + bm, j : j + bn].float() * s).to(dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 384), (3, 128, 256), (1536, 128)])
def test_block_fp8_equals_transformers_fp8_dequantize(shape, dtype):
    """Where transformers' ``Fp8Dequantize`` is defined (dims divisible by the block) it is ours bit for bit."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    weight, scale = _fp8_case(shape)
    theirs = Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=dtype)
    ours = block_fp8_decode(weight, scale, (128, 128), dtype)
    assert torch.equal(_bits(ours), _bits(theirs))


@pytest.mark.parametrize("shape", [(576, 256), (192, 256), (256, 200), (3, 130, 70)])
def test_block_fp8_partial_blocks_follow_the_declared_block(shape):
    """Trailing partial blocks by the declared [128, 128] (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows, 5 scale
    rows): equal to transformers' own ``_dequantize_fp8_weight`` (its declared-block backward dequantize, in
    fp32) and to an independent block-by-block reference."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    weight, scale = _fp8_case(shape, seed=1)
    ours = block_fp8_decode(weight, scale, (128, 128), torch.bfloat16)
    theirs = _dequantize_fp8_weight(weight, scale, [128, 128], torch.float32).to(torch.bfloat16)
    assert torch.equal(_bits(ours), _bits(theirs))
    assert torch.equal(_bits(ours), _bits(_reference(weight, scale, (128, 128), torch.bfloat16)))


def test_transformers_fp8_dequantize_infers_the_block_where_we_do_not():
    """The issue's two cases: 576/5 raises in transformers' ``Fp8Dequantize``; 192/2 gets 96-row blocks there."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    weight, scale = _fp8_case((576, 128))
    with pytest.raises(ValueError):
        Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=torch.float32)
    weight, scale = _fp8_case((192, 128), seed=2)
    theirs = Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=torch.float32)
    ours = block_fp8_decode(weight, scale, (128, 128), torch.float32)
    assert torch.equal(ours, _reference(weight, scale, (128, 128), torch.float32))
    assert not torch.equal(ours, theirs)


def test_block_fp8_non_square_block_bf16_scale_and_out():
    weight, scale = _fp8_case((100, 96), block=(64, 32), seed=3, scale_dtype=torch.bfloat16)
    out = torch.empty(100, 96, dtype=torch.bfloat16)
    got = block_fp8_decode(weight, scale, (64, 32), torch.bfloat16, out=out)
    assert got is out
    assert torch.equal(_bits(out), _bits(_reference(weight, scale, (64, 32), torch.bfloat16)))


def test_block_fp8_refusals():
    weight, scale = _fp8_case((576, 256))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        block_fp8_decode(weight.float(), scale)
    with pytest.raises(ValueError, match=r"must be \[5, 2\], got \[4, 2\]"):
        block_fp8_decode(weight, scale[:4])
    with pytest.raises(ValueError, match="float32/bfloat16"):
        block_fp8_decode(weight, scale.double())
    with pytest.raises(ValueError, match="weight_block_size"):
        block_fp8_decode(weight, scale, (128, 0))
    with pytest.raises(ValueError, match=r"\[\.\.\., out, in\]"):
        block_fp8_decode(weight[0], scale[0])
    with pytest.raises(ValueError, match="out must be"):
        block_fp8_decode(weight, scale, out=torch.empty(576, 256))


def _int4_scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True)
    return QuantizationScheme(targets=["Linear"], weights=args)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(64, 256), (7, 96)])
def test_int4_equals_compressed_tensors_decompressor(shape, scale_dtype):
    """Every INT4 value, packed by compressed-tensors' own ``pack_to_int32`` and by ours (same words),
    decoded by its ``PackedQuantizationCompressor`` and by ours: the same bits."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    q[0, :16] = torch.arange(-8, 8, dtype=torch.int8)
    packed = pack_to_int32(q, 4)
    assert torch.equal(int4_pack(q), packed)
    assert torch.equal(int4_unpack(packed, shape[1]), q)
    scale = (torch.exp2(torch.randn(shape[0], shape[1] // 32, generator=g) * 3) / 7).to(scale_dtype)
    state = {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor(shape)}
    theirs = PackedQuantizationCompressor.decompress(state, _int4_scheme())["weight"]
    ours = int4_packed_decode(packed, scale, shape[1], 32, dtype=theirs.dtype)
    assert theirs.dtype == scale_dtype
    assert torch.equal(_bits(ours), _bits(theirs))


def test_int4_stacked_experts_and_refusals():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (3, 16, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(3, 16, 2, generator=g).bfloat16()
    got = int4_packed_decode(int4_pack(q), scale)
    want = (q.float() * scale.float().repeat_interleave(32, -1)).bfloat16()
    assert torch.equal(_bits(got), _bits(want))
    with pytest.raises(ValueError, match="int32"):
        int4_unpack(int4_pack(q).view(torch.float32), 64)
    with pytest.raises(ValueError, match="cannot hold"):
        int4_unpack(int4_pack(q), 80)
    with pytest.raises(ValueError, match="does not match"):
        int4_packed_decode(int4_pack(q), scale[..., :1], 64)
    with pytest.raises(ValueError, match="-8..7"):
        int4_pack(torch.full((2, 8), 8, dtype=torch.int8))
