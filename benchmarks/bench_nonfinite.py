"""What the NaN/Inf checks cost (issue 10): each path checks bytes it has already read, once.

    python benchmarks/bench_nonfinite.py [--workdir DIR] [--repeats 5] [--experts 16]

1. ``nonfinite_count`` on a bf16 tensor vs the copy the loader makes of it into its parameter (both
   on bytes in memory; ``safe_open`` maps the file, so the read itself is the first touch of either).
2. ``load_pretrained`` on the tiny Kimi-K3, with the reader's value check on vs off.
3. ``convert_checkpoint`` (bench_convert's scaled-up checkpoint, mirror recipe) as shipped (floating
   tensors copied through the process and checked) vs copying them in the kernel unchecked, as before.
Timings alternate between the two sides (``common.time_interleaved``); overhead = median ratio - 1.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_convert import RECIPE, build_checkpoint  # noqa: E402
from benchmarks.common import time_interleaved, tiny_checkpoint, warm_page_cache  # noqa: E402


def _overhead(times: dict[str, list[float]]) -> str:
    checked, unchecked = statistics.median(times["checked"]), statistics.median(times["unchecked"])
    paired = sorted(c / u - 1 for c, u in zip(times["checked"], times["unchecked"]))
    return (f"{checked * 1e3:.1f} ms checked vs {unchecked * 1e3:.1f} ms unchecked: "
            f"{(checked / unchecked - 1) * 100:+.1f}% (paired {paired[0] * 100:+.1f}%..{paired[-1] * 100:+.1f}%)")


def check_vs_copy(repeats: int) -> str:
    import torch

    from modelopt_k3.numerics.finite import nonfinite_count

    tensor = torch.randn(4096, 7168).to(torch.bfloat16)  # one Kimi-K3-sized projection, in memory
    param = torch.empty_like(tensor)
    times = time_interleaved({"copy": lambda: param.copy_(tensor), "check": lambda: nonfinite_count(tensor)},
                             repeats)
    copy, check = statistics.median(times["copy"]), statistics.median(times["check"])
    return (f"nonfinite_count {check * 1e3:.2f} ms ({tensor.nbytes / check / 1e9:.1f} GB/s) vs the loader's own "
            f"copy of the same 4096x7168 bf16 tensor into its parameter {copy * 1e3:.2f} ms: "
            f"{check / copy * 100:.0f}% of the copy")


def load(workdir: Path, repeats: int) -> str:
    import torch

    from modelopt_k3 import load_pretrained
    from modelopt_k3.checkpoint import ReadLog

    ckpt = tiny_checkpoint(workdir, num_experts=64, moe_intermediate_size=256)
    record = ReadLog.record

    def run(check: bool):
        def once():
            ReadLog.record = (record if check else
                              lambda self, key, tensor, nbytes, _: record(self, key, tensor, nbytes, False))
            load_pretrained(ckpt, trust_remote_code=True, dtype=torch.bfloat16, progress=False)
        return once

    try:
        times = time_interleaved({"checked": run(True), "unchecked": run(False)}, repeats)
    finally:
        ReadLog.record = record
    return "load_pretrained tiny e64-m256: " + _overhead(times)


def convert(workdir: Path, repeats: int, experts: int) -> str:
    from modelopt_k3.convert import convert_checkpoint
    from modelopt_k3.export import writer

    ckpt = build_checkpoint(workdir, experts, 256)
    warm_page_cache(sorted(ckpt.glob("*.safetensors")))
    count = writer.nonfinite_count  # what checking a copied chunk costs: unchecked runs skip the count

    def run(check: bool, out: Path):
        def once():
            shutil.rmtree(out, ignore_errors=True)
            writer.nonfinite_count = count if check else (lambda t: 0)
            convert_checkpoint(ckpt, out, RECIPE)
        return once

    try:
        times = time_interleaved({"checked": run(True, workdir / "c1"), "unchecked": run(False, workdir / "c2")},
                                 repeats)
    finally:
        writer.nonfinite_count = count
    size = sum(p.stat().st_size for p in ckpt.glob("*.safetensors")) / 2**20
    return f"convert_checkpoint {size:.0f} MiB (e{experts}): " + _overhead(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--experts", type=int, default=16)
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-nonfinite-"))
    workdir.mkdir(parents=True, exist_ok=True)
    for line in (check_vs_copy(args.repeats), load(workdir, args.repeats),
                 convert(workdir, args.repeats, args.experts)):
        print(line, flush=True)


if __name__ == "__main__":
    main()
