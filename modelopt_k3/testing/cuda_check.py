"""Manual device check: our CPU implementations of the fla-core names against fla's Triton kernels on CUDA.

Run on a CUDA machine with triton + fla-core: `python -m modelopt_k3.testing.cuda_check`.
The remote code (real or stand-in) calls `ShortConvolution`, `FusedRMSNormGated`, `chunk_kda` and
`fused_recurrent_kda` exactly as below; on CPU our `models/kimi_k3/fla_cpu.py` stands in for them. This
runs both on the same inputs and prints the max differences, and also runs the tiny stand-in model on
CUDA in fp32 and bf16. Exits non-zero when one is out of tolerance.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from modelopt_k3.models.kimi_k3 import fla_cpu


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


def _op_checks(failures: list[str]) -> None:
    """Each fla name on CUDA (Triton) vs our CPU implementation, fp32, with the remote code's arguments."""
    from fla.modules import FusedRMSNormGated, ShortConvolution
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    g = torch.Generator().manual_seed(0)
    B, T, H, K = 2, 80, 2, 32
    x = torch.randn(B, T, H * K, generator=g)
    conv, cpu_conv = ShortConvolution(H * K, 4, activation="silu").cuda(), fla_cpu.ShortConvolution(H * K, 4)
    cpu_conv.load_state_dict(conv.state_dict())
    diffs = {"short_conv": _max_diff(conv(x=x.cuda())[0], cpu_conv(x=x)[0])}
    norm, cpu_norm = FusedRMSNormGated(K, eps=1e-5, activation="sigmoid").cuda(), fla_cpu.FusedRMSNormGated(K, eps=1e-5, activation="sigmoid")
    o, gate = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    diffs["rms_norm_gated"] = _max_diff(norm(o.cuda(), gate.cuda()), cpu_norm(o, gate))
    inputs = {
        "q": torch.randn(B, T, H, K, generator=g), "k": torch.randn(B, T, H, K, generator=g),
        "v": torch.randn(B, T, H, K, generator=g), "g": torch.randn(B, T, H, K, generator=g),
        "beta": torch.randn(B, T, H, generator=g), "A_log": torch.rand(H, generator=g) * 2,
        "dt_bias": 0.3 * torch.randn(H * K, generator=g),
    }  # fmt: skip
    flags = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, transpose_state_layout=True)  # fmt: skip
    cuda_in = {n: t.cuda() for n, t in inputs.items()}
    o_gpu, s_gpu = chunk_kda(**cuda_in, safe_gate=True, **flags)
    o_cpu, s_cpu = fla_cpu.chunk_kda(**inputs, safe_gate=True, **flags)
    diffs["chunk_kda_o"], diffs["chunk_kda_state"] = _max_diff(o_gpu, o_cpu), _max_diff(s_gpu, s_cpu)
    step = {n: (t[:, :1] if t.dim() > 1 else t) for n, t in inputs.items()}
    o_gpu, _ = fused_recurrent_kda(**{n: t.cuda() for n, t in step.items()}, initial_state=s_gpu, **flags)
    o_cpu, _ = fla_cpu.fused_recurrent_kda(**step, initial_state=s_cpu, **flags)
    diffs["fused_recurrent_kda_o"] = _max_diff(o_gpu, o_cpu)
    print(f"fla kernels (CUDA) vs our CPU implementations, fp32 |diff|: {diffs}")
    failures += [f"{k} {v:.2e}" for k, v in diffs.items() if v > 2e-3]


def _model_checks(failures: list[str]) -> None:
    from modelopt_k3.testing import make_tiny_kimi_k3
    from modelopt_k3.testing.reference import load_reference_model, reference_logits

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_kimi_k3(Path(tmp) / "ckpt")
        ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
        fp32 = reference_logits(load_reference_model(path).cuda(), ids)
        bf16 = reference_logits(load_reference_model(path, dtype=torch.bfloat16).cuda(), ids)
        cos = torch.nn.functional.cosine_similarity(bf16.float().flatten(), fp32.flatten(), dim=0)
        print(f"stand-in on CUDA: bf16 vs fp32 finite={bool(bf16.isfinite().all())} cosine={cos:.4f}")
        if not bool(bf16.isfinite().all()) or cos < 0.9:
            failures.append(f"bf16 cosine {cos:.4f}")


def main() -> int:
    print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "triton", fla_cpu.triton_available())
    if not torch.cuda.is_available() or not fla_cpu.triton_available():
        print("no CUDA device or no triton; nothing to check")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    failures: list[str] = []
    _op_checks(failures)
    _model_checks(failures)
    print("FAILURES:" if failures else "OK", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
