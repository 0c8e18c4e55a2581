"""Manual device check: the stand-in's CUDA path (fla-core kernels) against its CPU reference math.

Run on a CUDA machine with triton + fla-core: `python -m modelopt_k3.testing.cuda_check`.
Prints the max differences and exits non-zero when one is out of tolerance.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from modelopt_k3.testing import make_tiny_kimi_k3
from modelopt_k3.testing.reference import load_reference_model, reference_logits


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


def _kda_layer_checks(model: torch.nn.Module, failures: list[str]) -> None:
    """Each KDA layer on its own (chunked, padded, prefill + one recurrent step), CPU vs CUDA."""
    mkl = sys.modules[type(model.language_model).__module__]
    gen = torch.Generator().manual_seed(0)
    for idx, layer in enumerate(model.language_model.model.layers):
        attn = layer.self_attn
        if type(attn).__name__ != "KimiDeltaAttention":
            continue
        h = torch.randn(2, 80, attn.hidden_size, generator=gen)
        with torch.no_grad():
            cpu = attn(h)
            attn.cuda()
            gpu = attn(h.cuda())
            mask = torch.ones(2, 80, dtype=torch.long)
            mask[1, :7] = 0
            gpu_pad = attn(h.cuda(), attention_mask=mask.cuda())
            cache = mkl.KimiDynamicCache(model.config.text_config)
            attn(h[:, :-1].cuda(), cache_params=cache)
            gpu_step = attn(h[:, -1:].cuda(), cache_params=cache)
            attn.cpu()
            cpu_pad = attn(h, attention_mask=mask)
        diffs = {
            "chunk": _max_diff(cpu, gpu),
            "padded": _max_diff(cpu_pad, gpu_pad),
            "decode": _max_diff(cpu[:, -1:], gpu_step),
        }
        print(f"layer {idx} KDA fp32 |cpu-cuda| {diffs}  (|out| max {cpu.abs().max().item():.3f})")
        failures += [f"layer {idx} {k} {v:.2e}" for k, v in diffs.items() if v > 2e-2]


def _decode_mxfp4_fallback(packed: torch.Tensor, scale: torch.Tensor, scheme: object) -> torch.Tensor:
    """FORMATS.md rule; only used when compressed-tensors is not installed on the device machine."""
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    return (e2m1[codes] * torch.exp2(scale.float() - 127).repeat_interleave(32, dim=1)).to(torch.bfloat16)


def main() -> int:
    print("torch", torch.__version__, "cuda", torch.cuda.is_available())
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        from modelopt_k3.testing import reference

        print("compressed-tensors missing: using the FORMATS.md decoder and a stub scheme")
        reference._decode_mxfp4 = _decode_mxfp4_fallback
        reference._mxfp4_scheme = lambda config: None
    if not torch.cuda.is_available():
        print("no CUDA device; nothing to check")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_kimi_k3(Path(tmp) / "ckpt")
        model = load_reference_model(path)
        _kda_layer_checks(model, failures)
        ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
        cpu = reference_logits(model, ids)
        gpu = reference_logits(model.cuda(), ids.cuda())
        print(f"full model fp32 |cpu-cuda| {_max_diff(cpu, gpu):.3e} (|logits| max {cpu.abs().max():.2f})")
        model_bf16 = load_reference_model(path, dtype=torch.bfloat16).cuda()
        bf16 = reference_logits(model_bf16, ids.cuda())
        cos = torch.nn.functional.cosine_similarity(bf16.float().cpu().flatten(), cpu.flatten(), dim=0)
        print(f"full model bf16 cuda vs fp32 cpu: finite={bool(bf16.isfinite().all())} cosine={cos:.4f}")
        if not bool(bf16.isfinite().all()) or cos < 0.9:
            failures.append(f"bf16 cosine {cos:.4f}")
    print("FAILURES:" if failures else "OK", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
