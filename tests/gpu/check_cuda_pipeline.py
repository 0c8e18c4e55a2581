"""CUDA check of the whole pipeline on one GPU (run by hand where a GPU exists; CI has none).

    python tests/gpu/check_cuda_pipeline.py OUT_DIR

1. fused experts on CUDA (eager, grouped_mm, batched_mm) against the unpatched remote model's
   per-expert loop (fla kernels on CUDA for KDA), in fp32 and bf16;
2. numerics on CUDA bit-identical to the CPU results on a Kimi-K3-sized expert matrix, with timings;
3. hf_ptq on CUDA and on CPU (same calibration data) export the same checkpoint: weight-derived
   tensors byte-identical, activation scales within 1%.
Writes OUT_DIR/cuda_check.json and exits non-zero on a failed check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))


def check_logits(ckpt: Path, results: dict) -> None:
    from modelopt_k3 import load_pretrained
    from modelopt_k3.testing.reference import load_reference_model, reference_logits

    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0)).cuda()
    for dtype in (torch.float32, torch.bfloat16):
        from modelopt_k3.models.kimi_k3.prepare import unprepare
        from modelopt_k3.testing.reference import load_reference_class

        _, cls = load_reference_class(ckpt)
        unprepare(cls)
        ref = load_reference_model(ckpt, dtype=dtype).cuda()
        want = reference_logits(ref, ids).float()
        del ref
        model = load_pretrained(ckpt, trust_remote_code=True, dtype=dtype, progress=False)
        assert next(model.parameters()).is_cuda
        for impl in ("eager", "grouped_mm", "batched_mm"):
            model.config.text_config._experts_implementation = impl
            with torch.no_grad():
                got = model(input_ids=ids, use_cache=False).logits.float()
            rel = ((got - want).abs().max() / want.abs().max()).item()
            results[f"logits_rel_err_{str(dtype).split('.')[-1]}_{impl}"] = rel
            limit = 1e-5 if dtype == torch.float32 else 2e-2
            assert rel <= limit, f"{impl} {dtype}: relative logits error {rel:.3g} > {limit}"
        del model


def check_numerics(results: dict) -> None:
    from modelopt_k3.numerics import mxfp4_decode, mxfp4_encode, mxfp4_to_nvfp4, nvfp4_quantize

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3072, 3584, generator=g).to(torch.bfloat16)
    packed, scale = mxfp4_encode(w)
    cpu = (mxfp4_decode(packed, scale), nvfp4_quantize(w.float()), mxfp4_to_nvfp4(packed, scale)[0])
    gpu_in = (packed.cuda(), scale.cuda(), w.float().cuda())
    gpu = (mxfp4_decode(gpu_in[0], gpu_in[1]), nvfp4_quantize(gpu_in[2]), mxfp4_to_nvfp4(gpu_in[0], gpu_in[1])[0])
    assert torch.equal(cpu[0], gpu[0].cpu()), "mxfp4_decode differs on CUDA"
    for a, b, name in ((cpu[1], gpu[1], "nvfp4_quantize"), (cpu[2], gpu[2], "mxfp4_to_nvfp4")):
        for x, y in zip(a, b):
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.cpu().reshape(-1).view(torch.uint8)), name
    for name, fn in (
        ("mxfp4_decode", lambda: mxfp4_decode(gpu_in[0], gpu_in[1])),
        ("nvfp4_quantize", lambda: nvfp4_quantize(gpu_in[2])),
        ("mxfp4_to_nvfp4", lambda: mxfp4_to_nvfp4(gpu_in[0], gpu_in[1])),
    ):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        results[f"cuda_ms_{name}_3072x3584"] = (time.perf_counter() - t) / 20 * 1e3


def check_export(ckpt: Path, out: Path, results: dict) -> None:
    from test_expert_parallel import assert_exports_equal

    args = [sys.executable, str(REPO / "examples/hf_ptq.py"), "--pyt_ckpt_path", str(ckpt), "--trust_remote_code",
            "--qformat", "nvfp4", "--kv_cache_qformat", "fp8", "--calib_size", "8", "--batch_size", "2",
            "--calib_seq", "64", "--dtype", "float32", "--no_progress"]
    runs = {}
    # The CPU run needs our CPU fla-core path: with triton installed nothing is replaced unless forced.
    for name, env in (("cuda", {}), ("cpu", {"CUDA_VISIBLE_DEVICES": "", "MODELOPT_K3_FLA_CPU": "1"})):
        t = time.perf_counter()
        subprocess.run([*args, "--export_path", str(out / name)], check=True, env={**os.environ, **env})
        runs[name] = time.perf_counter() - t
    results["hf_ptq_wall_s"] = runs
    assert_exports_equal(out / "cpu", out / "cuda")


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    assert torch.cuda.is_available(), "no CUDA device"
    from modelopt_k3.testing import make_tiny_kimi_k3

    work = Path(tempfile.mkdtemp())
    ckpt = make_tiny_kimi_k3(work / "ckpt", num_experts=32)
    results: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    failures = []
    for name, fn in (("logits", lambda: check_logits(ckpt, results)), ("numerics", lambda: check_numerics(results)),
                     ("export", lambda: check_export(ckpt, work, results))):
        try:
            fn()
            results[f"{name}_ok"] = True
        except Exception as e:  # report every check, then fail
            results[f"{name}_ok"] = False
            results[f"{name}_error"] = f"{type(e).__name__}: {e}"
            failures.append(name)
    (out / "cuda_check.json").write_text(json.dumps(results, indent=2, default=str))
    print(json.dumps(results, indent=2, default=str))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
