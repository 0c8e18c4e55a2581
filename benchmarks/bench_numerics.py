"""Numeric kernels on real Kimi-K3 expert-matrix sizes, against compressed-tensors in the same run.

Shapes: ``[3072, 3584]``, ``[3584, 3072]`` (out, in) and a batch of 8 ``[3072, 3584]`` matrices.
compressed-tensors compresses one module at a time, so its side loops over the 8 matrices; ours
takes the batch in one call (which is how the loader and exporter call it).

What is timed, exactly (inputs are built before timing; nothing is cached between calls except
the decode/encode lookup tables both libraries build once):

- ``mxfp4_decode``: ``mxfp4_decode(weight_packed, weight_scale, bf16)`` vs
  ``MXFP4PackedCompressor.decompress({"weight_packed", "weight_scale"}, scheme)["weight"]`` (bf16).
  Outputs are checked bit-equal before timing.
- ``nvfp4_quantize``: from a bf16 weight to (packed E2M1 codes, e4m3 block scales, fp32 global
  scale). Ours: ``nvfp4_quantize(w)`` (amax, global scale, block scales, codes, packing). Reference:
  the same products the compressed-tensors way: tensor amax -> ``generate_gparam``, per-16 block
  amin/amax (fp32, as llm-compressor's observer) -> ``calculate_qparams`` (e4m3 scales) ->
  ``NVFP4PackedCompressor.compress`` (quantize + pack, scale cast). ``nvfp4_quantize_vs_ct_compress``
  (report-only) times ``compress`` alone, given the scales, against all of ours.
- ``mxfp4_to_nvfp4``: the lossless cast ``mxfp4_to_nvfp4(weight_packed, weight_scale)`` vs our own
  ``nvfp4_quantize(mxfp4_decode(weight_packed, weight_scale))``.
- ``*_bandwidth``: (bytes read + bytes written) / median time of each of our kernels on the batch,
  as a fraction of the copy bandwidth 2 * nbytes / time of ``torch.clone`` of a large tensor.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

from .common import GB, Figure, MiB, summary, time_interleaved, timing_figure

AREA = "numerics"
FULL_SHAPES = [(3072, 3584), (3584, 3072), (8, 3072, 3584)]
QUICK_SHAPES = [(128, 256), (2, 128, 256)]


def _shape_name(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def _mxfp4_inputs(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random E2M1 codes and E8M0 exponents like a real expert (values ~ 1/sqrt(in), +-1 jitter)."""
    g = torch.Generator().manual_seed(seed)
    *lead, n = shape
    packed = torch.randint(0, 256, (*lead, n // 2), generator=g, dtype=torch.uint8)
    base = 127 - round(math.log2(2.9 * math.sqrt(n)))
    scale = (base + torch.randint(-1, 2, (*lead, n // 32), generator=g)).to(torch.uint8)
    return packed, scale


def _bf16_weight(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) / math.sqrt(shape[-1])).to(torch.bfloat16)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ----------------------------------------------------------------------------- compressed-tensors side


def _ct_mxfp4_scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(
        num_bits=4, type="float", strategy="group", group_size=32, symmetric=True, dynamic=False,
        scale_dtype=torch.uint8,
    )
    return QuantizationScheme(targets=["Linear"], weights=args)


def _ct_mxfp4_decode(packed: torch.Tensor, scale: torch.Tensor, scheme) -> torch.Tensor:
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor

    if packed.dim() == 2:
        return MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, scheme)["weight"]
    return torch.stack([_ct_mxfp4_decode(p, s, scheme) for p, s in zip(packed, scale)])


def _ct_nvfp4_scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(
        num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
        scale_dtype=torch.float8_e4m3fn,
    )
    return QuantizationScheme(targets=["Linear"], weights=args)


def _ct_nvfp4_scales(w: torch.Tensor, scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' global scale and e4m3-rounded block scales of a 2-D weight."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    amax = w.abs().amax().float()
    gs = generate_gparam(-amax, amax)
    wb = w.float().view(w.shape[0], -1, 16)
    scale, _ = calculate_qparams(wb.amin(-1), wb.amax(-1), scheme.weights, global_scale=gs)
    return gs, scale


def _ct_nvfp4_compress(w: torch.Tensor, gs: torch.Tensor, scale: torch.Tensor, scheme) -> dict:
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    return NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme
    )


def _ct_nvfp4(w: torch.Tensor, scheme) -> list[dict]:
    mats = [w] if w.dim() == 2 else list(w)
    out = []
    for m in mats:
        gs, scale = _ct_nvfp4_scales(m, scheme)
        out.append(_ct_nvfp4_compress(m, gs, scale, scheme))
    return out


# ----------------------------------------------------------------------------------------- figures


def copy_bandwidth(nbytes: int, repeats: int) -> dict[str, Any]:
    """GB/s of ``torch.clone`` (fresh output, as our kernels allocate theirs) and of ``copy_`` into a
    preallocated buffer, counting bytes read + bytes written."""
    x = torch.empty(nbytes, dtype=torch.uint8)
    x.fill_(1)
    dst = torch.empty_like(x)
    dst.fill_(0)
    times = time_interleaved({"clone": lambda: x.clone(), "copy_": lambda: dst.copy_(x)}, repeats)
    return {
        "nbytes": nbytes,
        "clone": summary(times["clone"]),
        "copy_": summary(times["copy_"]),
        "clone_gbps": 2 * nbytes / statistics.median(times["clone"]) / GB,
        "copy_gbps": 2 * nbytes / statistics.median(times["copy_"]) / GB,
    }


def _bandwidth_bound(kernel: str, io: int, gbps: float) -> str:
    return (f"memory traffic: {kernel} reads and writes {io / MiB:.1f} MiB at {gbps:.2f} GB/s; the "
            f"'{kernel} GB/s vs torch.clone' figure gives the fraction of this machine's copy bandwidth")


def _shape_figures(ctx, i: int, shape: tuple[int, ...], kernel_gbps: dict[str, dict[str, float]]) -> list[Figure]:
    from modelopt_k3.numerics import mxfp4_decode, mxfp4_to_nvfp4, nvfp4_dequantize, nvfp4_quantize

    mx_scheme, nv_scheme = _ct_mxfp4_scheme(), _ct_nvfp4_scheme()
    sname = _shape_name(shape)
    batched = len(shape) == 3
    loop = " (loop over the batch)" if batched else ""
    # single matrices are quick: more repeats steady the medians on a shared machine
    repeats = ctx.repeats if (ctx.quick or batched) else 2 * ctx.repeats - 1
    packed, scale = _mxfp4_inputs(shape, seed=10 + i)
    w = _bf16_weight(shape, seed=20 + i)
    ctx.log(f"numerics {sname}: {repeats} repeats")
    figures = []

    # -- MXFP4 -> BF16 decode
    ours = mxfp4_decode(packed, scale)
    exact = torch.equal(ours.view(torch.int16), _ct_mxfp4_decode(packed, scale, mx_scheme).view(torch.int16))
    times = time_interleaved(
        {"ours": lambda: mxfp4_decode(packed, scale), "ref": lambda: _ct_mxfp4_decode(packed, scale, mx_scheme)},
        repeats,
    )
    io = _nbytes(packed, scale, ours)
    kernel_gbps["mxfp4_decode"][sname] = io / statistics.median(times["ours"]) / GB
    figures.append(timing_figure(
        f"mxfp4_decode/{sname}", AREA, f"MXFP4 -> BF16 decode {sname}",
        "modelopt_k3.numerics.mxfp4_decode", "compressed_tensors MXFP4PackedCompressor.decompress" + loop,
        times, target=5.0, target_text=">= 5x faster",
        details={"bit_equal_to_reference": exact, "bytes_in_out": io, "ours_gbps": kernel_gbps["mxfp4_decode"][sname]},
        bound=_bandwidth_bound("mxfp4_decode", io, kernel_gbps["mxfp4_decode"][sname]),
        checks={"bit_equal_to_reference": exact},
    ))

    # -- NVFP4 quantize + pack from bf16
    q = nvfp4_quantize(w)
    ct = _ct_nvfp4(w, nv_scheme)
    ct_gs = torch.stack([1 / c["weight_global_scale"].reshape(()) for c in ct])
    ours_packed = q.packed.view(-1, *q.packed.shape[-2:])
    agree = torch.stack([(c["weight_packed"] == p).float().mean() for c, p in zip(ct, ours_packed)])
    times = time_interleaved({"ours": lambda: nvfp4_quantize(w), "ref": lambda: _ct_nvfp4(w, nv_scheme)}, repeats)
    io = _nbytes(w, q.packed, q.block_scale, q.global_scale)
    kernel_gbps["nvfp4_quantize"][sname] = io / statistics.median(times["ours"]) / GB
    figures.append(timing_figure(
        f"nvfp4_quantize/{sname}", AREA, f"NVFP4 quantize+pack {sname}",
        "modelopt_k3.numerics.nvfp4_quantize (amax, global scale, e4m3 scales, codes, packing)",
        "compressed_tensors generate_gparam + calculate_qparams + NVFP4PackedCompressor.compress" + loop,
        times, target=10.0, target_text=">= 10x faster",
        bound=_bandwidth_bound("nvfp4_quantize", io, kernel_gbps["nvfp4_quantize"][sname]),
        details={
            "bytes_in_out": io, "ours_gbps": kernel_gbps["nvfp4_quantize"][sname],
            "global_scale_max_rel_diff": float(((ct_gs - q.global_scale.reshape(-1)).abs() / ct_gs).max()),
            "packed_byte_agreement_min": float(agree.min()),
            "note": "bf16 ties may round one step apart (see tests/numerics/test_numerics.py "
                    "test_nvfp4_against_compressed_tensors); the work done is the same",
        },
    ))
    # report-only: compressed-tensors' compress() alone, its scales precomputed outside the timing
    mats = [w] if not batched else list(w)
    scales = [_ct_nvfp4_scales(m, nv_scheme) for m in mats]
    times = time_interleaved(
        {"ours": lambda: nvfp4_quantize(w),
         "ref": lambda: [_ct_nvfp4_compress(m, gs, s, nv_scheme) for m, (gs, s) in zip(mats, scales)]},
        repeats,
    )
    figures.append(timing_figure(
        f"nvfp4_quantize_vs_ct_compress/{sname}", AREA, f"NVFP4 quantize+pack vs CT compress() only {sname}",
        "modelopt_k3.numerics.nvfp4_quantize (all of it)", "NVFP4PackedCompressor.compress only (scales given)",
        times, target=None, target_text="report only",
    ))

    # -- MXFP4 -> NVFP4 lossless cast vs decode + quantize
    cast, n_req = mxfp4_to_nvfp4(packed, scale)
    lossless = None
    if not batched:
        lossless = torch.equal(
            nvfp4_dequantize(*cast, dtype=torch.bfloat16).view(torch.int16), ours.view(torch.int16)
        )
    times = time_interleaved(
        {"ours": lambda: mxfp4_to_nvfp4(packed, scale), "ref": lambda: nvfp4_quantize(mxfp4_decode(packed, scale))},
        repeats,
    )
    io = _nbytes(packed, scale, cast.packed, cast.block_scale, cast.global_scale)
    kernel_gbps["mxfp4_to_nvfp4"][sname] = io / statistics.median(times["ours"]) / GB
    figures.append(timing_figure(
        f"mxfp4_to_nvfp4/{sname}", AREA, f"MXFP4 -> NVFP4 lossless cast {sname}",
        "modelopt_k3.numerics.mxfp4_to_nvfp4", "nvfp4_quantize(mxfp4_decode(...)) (ours)",
        times, target=2.0, target_text=">= 2x faster",
        details={"requantized_blocks": n_req, "dequant_equals_decode_bf16": lossless, "bytes_in_out": io,
                 "ours_gbps": kernel_gbps["mxfp4_to_nvfp4"][sname]},
        bound=_bandwidth_bound("mxfp4_to_nvfp4", io, kernel_gbps["mxfp4_to_nvfp4"][sname]),
        # a cast with no requantized block must dequantize to the decode, bit for bit
        checks={} if lossless is None or n_req else {"dequant_equals_decode_bf16": lossless},
    ))
    return figures


def run(ctx) -> list[Figure]:
    shapes = QUICK_SHAPES if ctx.quick else FULL_SHAPES
    figures: list[Figure] = []
    kernel_gbps: dict[str, dict[str, float]] = {"mxfp4_decode": {}, "nvfp4_quantize": {}, "mxfp4_to_nvfp4": {}}
    for i, shape in enumerate(shapes):
        figures += _shape_figures(ctx, i, shape, kernel_gbps)

    # -- GB/s vs memory copy bandwidth (the largest shape's figures; every shape in details)
    bw = copy_bandwidth((8 if ctx.quick else 512) * MiB, ctx.repeats)
    ctx.log(f"copy bandwidth: clone {bw['clone_gbps']:.2f} GB/s, copy_ {bw['copy_gbps']:.2f} GB/s")
    big = _shape_name(shapes[-1])
    for kernel, by_shape in kernel_gbps.items():
        figures.append(Figure(
            name=f"{kernel}_bandwidth/{big}", area=AREA,
            title=f"{kernel} GB/s vs torch.clone {big}",
            ours={"label": f"{kernel} (bytes read + written) / s", "gbps": by_shape[big], "by_shape": by_shape},
            reference={"label": "torch.clone of a large tensor (2 x nbytes / s)", "gbps": bw["clone_gbps"]},
            ratio=by_shape[big] / bw["clone_gbps"], target=None, target_text="report the fraction", unit="GB/s",
            details={"copy_bandwidth": bw,
                     "fraction_of_copy_into_preallocated": by_shape[big] / bw["copy_gbps"]},
        ))
    return figures
