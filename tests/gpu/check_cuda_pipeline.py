"""CUDA check of the whole pipeline on one GPU (run by hand where a GPU exists; CI has none).

    python tests/gpu/check_cuda_pipeline.py OUT_DIR          # on a CUDA machine (~5 min on one H200)
    python tests/gpu/check_cuda_pipeline.py OUT_DIR --cpu    # dry run of the same script on CPU

1. logits: fused experts (eager, grouped_mm, batched_mm) against the unpatched remote model's
   per-expert loop (fla kernels on CUDA for KDA), in fp32 and bf16; packed-resident experts (whole
   layer and 3 experts at a time) bit-identical to bf16 residency under each implementation (fp32 chunks
   under grouped_mm/batched_mm: within 1e-5, as their GEMMs of other shapes may round differently); the
   owner's grouped GEMM: torch_a2a in one process runs the plan's local implementation (grouped_mm
   on CUDA), which must be the one called, with logits equal to eager;
2. numerics on CUDA bit-identical to the CPU results on a Kimi-K3-sized expert matrix, with timings;
   decode and workspace timings per layer: one Kimi-K3 MoE layer's local experts at EP 16 (56 x three
   3072x3584 MXFP4 matrices) decoded into the reusable workspace vs ``mxfp4_decode`` allocating, and
   the tiny model's per-layer experts forward with packed vs bf16 experts (the decode share);
3. export: hf_ptq on CUDA (bf16 experts, and packed experts) and on CPU (same calibration data)
   write the same checkpoint: weight-derived tensors byte-identical, activation scales within 1%.
Writes OUT_DIR/cuda_check.json and exits non-zero on a failed check. ``--cpu`` runs everything on the
CPU instead (comparisons of CUDA against CPU become CPU against CPU): it proves the script, not a GPU.
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
CPU_ONLY = "--cpu" in sys.argv
DEVICE = torch.device("cpu" if CPU_ONLY else "cuda")
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, repeats: int = 10) -> float:
    fn()
    _sync()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync()
    return (time.perf_counter() - t) / repeats * 1e3


def _experts(model):
    return model.modelopt_k3.spec.experts_modules(model)


def check_logits(ckpt: Path, results: dict) -> None:
    from modelopt_k3 import load_pretrained
    from modelopt_k3.models.kimi_k3.prepare import unprepare
    from modelopt_k3.testing.reference import load_reference_class, load_reference_model, reference_logits

    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        _, cls = load_reference_class(ckpt)
        unprepare(cls)
        ref = load_reference_model(ckpt, dtype=dtype).to(DEVICE)
        want = reference_logits(ref, ids).float()
        del ref
        models = {r: load_pretrained(ckpt, trust_remote_code=True, dtype=dtype, experts=r, progress=False)
                  for r in ("bf16", "packed")}
        assert next(models["bf16"].parameters()).device.type == DEVICE.type
        limit = 1e-5 if dtype == torch.float32 else 2e-2
        for impl in IMPLEMENTATIONS:
            if impl == "grouped_mm" and DEVICE.type == "cuda" and dtype != torch.bfloat16:
                results[f"logits_{name}_{impl}"] = "skipped: torch's grouped_mm kernel takes bf16 only"
                continue
            for m in models.values():
                m.config.text_config._experts_implementation = impl
            with torch.no_grad():
                got = models["bf16"](input_ids=ids, use_cache=False).logits
                for chunk in (None, 3):
                    for module in _experts(models["packed"]).values():
                        module.decode_chunk = chunk or module.num_experts
                    packed = models["packed"](input_ids=ids, use_cache=False).logits
                    if chunk is None or impl == "eager" or dtype == torch.bfloat16:
                        assert torch.equal(packed, got), \
                            f"packed experts (decode_chunk={chunk}) differ from bf16, {impl} {name}"
                    else:  # fp32 GEMMs of other shapes: the BLAS may sum in another order (~1 ulp per GEMM)
                        rel = ((packed - got).abs().max() / got.abs().max()).item()
                        results[f"packed_chunked_rel_diff_{name}_{impl}"] = rel
                        assert rel <= 1e-5, f"packed experts (decode_chunk=3) {impl} {name}: relative {rel:.3g}"
            rel = ((got.float() - want).abs().max() / want.abs().max()).item()
            results[f"logits_rel_err_{name}_{impl}"] = rel
            assert rel <= limit, f"{impl} {dtype}: relative logits error {rel:.3g} > {limit}"
        results[f"packed_equals_bf16_{name}"] = True
        del models
        _check_owner_implementation(ckpt, ids, dtype, want, limit, results)


def _check_owner_implementation(ckpt: Path, ids, dtype, want, limit: float, results: dict) -> None:
    """torch_a2a with one rank dispatches to the plan's local implementation: grouped_mm on CUDA."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from modelopt_k3 import load_pretrained
    from modelopt_k3.experts.dispatch import register_torch_a2a

    register_torch_a2a()
    name = str(dtype).split(".")[-1]
    calls: dict[str, int] = {}
    originals = {impl: ALL_EXPERTS_FUNCTIONS[impl] for impl in ("grouped_mm", "batched_mm")}
    for impl, real in originals.items():

        def counted(*a, _real=real, _impl=impl, **k):
            calls[_impl] = calls.get(_impl, 0) + 1
            return _real(*a, **k)

        ALL_EXPERTS_FUNCTIONS[impl] = counted
    try:
        model = load_pretrained(ckpt, trust_remote_code=True, dtype=dtype, experts="packed", progress=False,
                                experts_implementation="torch_a2a")
        local = model.modelopt_k3.plan.local_experts_implementation
        with torch.no_grad():
            got = model(input_ids=ids, use_cache=False).logits.float()
    finally:
        for impl, real in originals.items():
            ALL_EXPERTS_FUNCTIONS[impl] = real
    results[f"owner_local_implementation_{name}"] = local
    results[f"owner_calls_{name}"] = calls
    want_impl = "grouped_mm" if DEVICE.type == "cuda" and dtype == torch.bfloat16 else "eager"
    assert local == want_impl, f"the plan chose {local} for the owner, expected {want_impl}"
    assert calls.get("grouped_mm", 0) > 0 if want_impl == "grouped_mm" else not calls, calls
    rel = ((got - want).abs().max() / want.abs().max()).item()
    results[f"owner_{local}_logits_rel_err_{name}"] = rel
    assert rel <= limit, f"owner {local} {dtype}: relative logits error {rel:.3g} > {limit}"


def check_numerics(results: dict) -> None:
    from modelopt_k3.numerics import mxfp4_decode, mxfp4_encode, mxfp4_to_nvfp4, nvfp4_quantize

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3072, 3584, generator=g).to(torch.bfloat16)
    packed, scale = mxfp4_encode(w)
    cpu = (mxfp4_decode(packed, scale), nvfp4_quantize(w.float()), mxfp4_to_nvfp4(packed, scale)[0])
    dev_in = (packed.to(DEVICE), scale.to(DEVICE), w.float().to(DEVICE))
    dev = (mxfp4_decode(dev_in[0], dev_in[1]), nvfp4_quantize(dev_in[2]), mxfp4_to_nvfp4(dev_in[0], dev_in[1])[0])
    assert torch.equal(cpu[0], dev[0].cpu()), "mxfp4_decode differs on the device"
    for a, b, name in ((cpu[1], dev[1], "nvfp4_quantize"), (cpu[2], dev[2], "mxfp4_to_nvfp4")):
        for x, y in zip(a, b):
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.cpu().reshape(-1).view(torch.uint8)), name
    for name, fn in (
        ("mxfp4_decode", lambda: mxfp4_decode(dev_in[0], dev_in[1])),
        ("nvfp4_quantize", lambda: nvfp4_quantize(dev_in[2])),
        ("mxfp4_to_nvfp4", lambda: mxfp4_to_nvfp4(dev_in[0], dev_in[1])),
    ):
        results[f"{DEVICE.type}_ms_{name}_3072x3584"] = _time(fn, 20)


def check_decode_workspace(ckpt: Path, results: dict) -> None:
    """Per layer: a Kimi-K3 MoE layer's local experts at EP 16 decoded into the reusable workspace, against
    mxfp4_decode allocating its output; and the tiny model's experts forward, packed vs bf16."""
    from modelopt_k3 import load_pretrained
    from modelopt_k3.experts.packed import DecodeWorkspace, PackedLayout
    from modelopt_k3.numerics import mxfp4_decode

    experts = 56 if DEVICE.type == "cuda" else 2  # 896 / 16 on a GPU; a smoke size on CPU
    g = torch.Generator().manual_seed(1)
    ws = DecodeWorkspace()
    layouts = {p: PackedLayout(p, experts, o, i, torch.bfloat16) for p, o, i in
               (("gate_up_proj", 2 * 3072, 3584), ("down_proj", 3584, 3072))}
    fields = {p: (torch.randint(0, 256, (experts, lay.out_features, lay.in_features // 2), generator=g,
                                dtype=torch.uint8).to(DEVICE),
                  torch.randint(110, 130, (experts, lay.out_features, lay.in_features // 32), generator=g,
                                dtype=torch.uint8).to(DEVICE)) for p, lay in layouts.items()}

    def into_workspace():
        for p, lay in layouts.items():
            with ws.rows(lay, experts, DEVICE) as buf:
                mxfp4_decode(*fields[p], torch.bfloat16, out=buf)

    def allocating():
        for p in layouts:
            mxfp4_decode(*fields[p], torch.bfloat16)

    ws_ms, alloc_ms = _time(into_workspace, 5), _time(allocating, 5)
    decoded = sum(lay.decoded_bytes(experts) for lay in layouts.values())
    results["kimi_layer_local_experts"] = experts
    results["kimi_layer_decode_workspace_ms"] = ws_ms
    results["kimi_layer_decode_allocating_ms"] = alloc_ms
    results["kimi_layer_decode_GBps"] = decoded / ws_ms / 1e6
    results["kimi_layer_workspace_GiB"] = ws.nbytes / 2**30
    assert ws_ms <= 1.3 * alloc_ms + 0.5, f"workspace decode {ws_ms:.2f} ms vs allocating {alloc_ms:.2f} ms"

    ids = torch.randint(0, 256, (4, 256), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    per_layer = {}
    for residency in ("bf16", "packed"):
        model = load_pretrained(ckpt, trust_remote_code=True, experts=residency, progress=False)
        model.config.text_config._experts_implementation = "grouped_mm" if DEVICE.type == "cuda" else "eager"
        timings: dict[str, list[float]] = {}
        hooks = []
        for name, module in _experts(model).items():
            def pre(mod, args, _n=name, _t=timings):
                _sync()
                _t.setdefault(_n, []).append(-time.perf_counter())

            def post(mod, args, out, _n=name, _t=timings):
                _sync()
                _t[_n][-1] += time.perf_counter()

            hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        with torch.no_grad():
            for _ in range(4):
                model(input_ids=ids, use_cache=False)
        per_layer[residency] = {n: sorted(t[1:])[len(t[1:]) // 2] * 1e3 for n, t in timings.items()}
        for h in hooks:
            h.remove()
        del model
    results["tiny_experts_forward_ms_per_layer"] = per_layer
    results["tiny_packed_decode_share"] = {
        n: 1 - per_layer["bf16"][n] / per_layer["packed"][n] for n in per_layer["bf16"]}


def check_export(ckpt: Path, out: Path, results: dict) -> None:
    from dist.test_expert_parallel import assert_exports_equal

    args = [sys.executable, str(REPO / "examples/hf_ptq.py"), "--pyt_ckpt_path", str(ckpt), "--trust_remote_code",
            "--qformat", "nvfp4", "--kv_cache_qformat", "fp8", "--calib_size", "8", "--batch_size", "2",
            "--calib_seq", "64", "--dtype", "float32", "--no_progress"]
    runs = {}
    # The CPU run needs our CPU fla-core path: with triton installed nothing is replaced unless forced.
    cpu_env = {"CUDA_VISIBLE_DEVICES": "", "MODELOPT_K3_FLA_CPU": "1"}
    device_env = {} if DEVICE.type == "cuda" else cpu_env
    for name, env, experts in (("device-bf16", device_env, "bf16"), ("device-packed", device_env, "packed"),
                               ("cpu", cpu_env, "bf16")):
        t = time.perf_counter()
        subprocess.run([*args, "--experts", experts, "--export_path", str(out / name)], check=True,
                       env={**os.environ, **env})
        runs[name] = time.perf_counter() - t
    results["hf_ptq_wall_s"] = runs
    assert_exports_equal(out / "cpu", out / "device-bf16")
    assert_exports_equal(out / "cpu", out / "device-packed")


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = Path(args[0] if args else tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    assert CPU_ONLY or torch.cuda.is_available(), "no CUDA device (use --cpu for a dry run)"
    from modelopt_k3.testing import make_tiny_kimi_k3

    work = Path(tempfile.mkdtemp())
    ckpt = make_tiny_kimi_k3(work / "ckpt", num_experts=32)
    results: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if not CPU_ONLY else "cpu (dry run)"}
    failures = []
    t0 = time.perf_counter()
    for name, fn in (("logits", lambda: check_logits(ckpt, results)), ("numerics", lambda: check_numerics(results)),
                     ("decode_workspace", lambda: check_decode_workspace(ckpt, results)),
                     ("export", lambda: check_export(ckpt, work, results))):
        t = time.perf_counter()
        try:
            fn()
            results[f"{name}_ok"] = True
        except Exception as e:  # report every check, then fail
            results[f"{name}_ok"] = False
            results[f"{name}_error"] = f"{type(e).__name__}: {e}"
            failures.append(name)
        results[f"{name}_wall_s"] = time.perf_counter() - t
    results["total_wall_s"] = time.perf_counter() - t0
    (out / "cuda_check.json").write_text(json.dumps(results, indent=2, default=str))
    print(json.dumps(results, indent=2, default=str))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
