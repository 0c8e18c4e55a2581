"""Prove that two revisions export the same checkpoints: every tensor's bytes and every JSON file.

A refactor must leave every export byte-identical (issue 11). This script checks out two
revisions as temporary git worktrees, runs the same matrix of exports with each on one tiny
stand-in checkpoint per model (generated once, by the first revision), and compares the results::

    python scripts/export_identity.py --base main            # main vs the working tree
    python scripts/export_identity.py --base A --head B      # two revisions
    python scripts/export_identity.py --only nvfp4 ep2_nvfp4 # a subset of the matrix

The matrix: every preset (one process), the Kimi-K3 mirror recipe, the KV-cache variant, both
export formats, EP 1/2/4, EP 2 with an FSDP2 dense part, the fsdp2 plan and the streaming
converter (the mirror recipe and the CLI's default). Tensors are compared by name, dtype, shape
and bytes; shard files of the same name must also be byte-identical (header layout included). A
configuration a revision does not support (its CLI refuses a flag) is reported as
such, not as a difference. Exit code 0 only if every configuration both revisions ran is identical.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

REPO = Path(__file__).resolve().parents[1]
MIRROR = "models/moonshotai/Kimi-K3/nvfp4_experts-fp8_pb_attention"


@dataclass(frozen=True)
class Config:
    name: str
    ranks: int  # 0: the streaming converter, one process
    args: tuple[str, ...]
    model: str = "kimi_k3"  # the stand-in exported (its spec's ``stand_in``, ``testing.make_tiny``)


MATRIX = (
    Config("nvfp4", 1, ("--qformat", "nvfp4")),
    Config("nvfp4_experts_only", 1, ("--qformat", "nvfp4_experts_only")),
    Config("w4a16_nvfp4", 1, ("--qformat", "w4a16_nvfp4")),
    Config("fp8", 1, ("--qformat", "fp8")),
    Config("nvfp4_kv_fp8", 1, ("--qformat", "nvfp4", "--kv_cache_qformat", "fp8")),
    Config("mirror", 1, ("--recipe", MIRROR)),
    Config("nvfp4_ct", 1, ("--qformat", "nvfp4", "--export_format", "compressed-tensors")),
    Config("w4a16_nvfp4_ct", 1, ("--qformat", "w4a16_nvfp4", "--export_format", "compressed-tensors")),
    Config("ep2_nvfp4", 2, ("--qformat", "nvfp4")),
    Config("ep4_nvfp4", 4, ("--qformat", "nvfp4")),
    Config("ep2_dense_fsdp2", 2, ("--qformat", "nvfp4", "--dense", "fsdp2")),
    Config("fsdp2_nvfp4", 2, ("--qformat", "nvfp4", "--plan", "fsdp2")),
    Config("convert_mirror", 0, ("--recipe", MIRROR)),
    Config("convert_default", 0, ()),  # the CLI's default recipe, models/moonshotai/Kimi-K3/nvfp4_experts
    # One export per transformers-native model (their specs share models/common/): the KV-cache variant on
    # DeepSeek-V3 covers the shared MLA site, EP 2 on Qwen3-MoE the shared expert-order combine.
    Config("qwen3_moe_nvfp4", 1, ("--qformat", "nvfp4"), model="qwen3_moe"),
    Config("qwen3_moe_ep2_nvfp4", 2, ("--qformat", "nvfp4"), model="qwen3_moe"),
    # GPTQ's routed experts (solved in batches since decision 0008), one process and EP 2.
    Config("qwen3_moe_nvfp4_gptq", 1, ("--qformat", "nvfp4_gptq"), model="qwen3_moe"),
    Config("qwen3_moe_ep2_nvfp4_gptq", 2, ("--qformat", "nvfp4_gptq"), model="qwen3_moe"),
    Config("gpt_oss_nvfp4", 1, ("--qformat", "nvfp4"), model="gpt_oss"),
    Config("deepseek_v3_nvfp4_kv_fp8", 1, ("--qformat", "nvfp4", "--kv_cache_qformat", "fp8"), model="deepseek_v3"),
    Config("deepseek_v3_convert", 0, (), model="deepseek_v3"),
    # Layerwise (one layer resident at a time): the same exports; the report it now writes sits in a subfolder.
    Config("layerwise_nvfp4_kv_fp8", 1, ("--qformat", "nvfp4", "--kv_cache_qformat", "fp8", "--layerwise")),
    Config("layerwise_ep2_nvfp4", 2, ("--qformat", "nvfp4", "--layerwise")),
    Config("qwen3_moe_layerwise_nvfp4", 1, ("--qformat", "nvfp4", "--layerwise"), model="qwen3_moe"),
)


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _checkout(rev: str | None, root: Path) -> Path:
    """A worktree of ``rev``; None means the working tree itself (uncommitted changes included)."""
    if rev is None:
        return REPO
    path = root / f"rev-{_git('rev-parse', '--short', rev)}"
    if not path.exists():
        _git("worktree", "add", "--detach", str(path), rev)
    return path


def _env(tree: Path, scratch: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(tree),
        "HF_MODULES_CACHE": str(scratch / "hf_modules"),
        "MODELOPT_K3_CACHE": str(scratch / "cache"),
        "OMP_NUM_THREADS": "1",
    }


def _make_checkpoint(tree: Path, scratch: Path, model: str) -> Path:
    ckpt = scratch / f"tiny_{model}"
    if not ckpt.exists():
        code = f"from modelopt_k3.testing import make_tiny; make_tiny({model!r}, {str(ckpt)!r}, seed=0)"
        subprocess.run([sys.executable, "-c", code], env=_env(tree, scratch), check=True)
    return ckpt


def _free_port() -> int:
    """A port no process listens on now, the kernel's pick: two runs of this script at once (fixed ports
    29600 + i before) would meet at one torchrun rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tree: Path, scratch: Path, ckpt: Path, cfg: Config, out: Path) -> tuple[bool, str]:
    if cfg.ranks == 0:
        cmd = [sys.executable, "-m", "modelopt_k3.cli.convert", "--src", str(ckpt), "--dst", str(out), *cfg.args]
    else:
        launcher = [sys.executable]
        if cfg.ranks > 1:
            launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(cfg.ranks), "--master_port",
                         str(_free_port())]
        cmd = [*launcher, str(tree / "examples/hf_ptq.py"), "--pyt_ckpt_path", str(ckpt), "--trust_remote_code",
               "--export_path", str(out), "--no_progress", *cfg.args]
    proc = subprocess.run(cmd, env=_env(tree, scratch), cwd=scratch, capture_output=True, text=True, timeout=1800)
    return proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def _tensor_bytes(t) -> bytes:
    import torch

    head = f"{t.dtype}{list(t.shape)}".encode()
    return head + (t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def _read_tensors(export: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for shard in sorted(export.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                out[key] = _tensor_bytes(f.get_tensor(key))
    return out


def compare(a: Path, b: Path) -> list[str]:
    """Differences between two export directories: tensors by name and bytes, same-named shards by file bytes, JSON
    by value, other files by bytes."""
    diffs: list[str] = []
    ta, tb = _read_tensors(a), _read_tensors(b)
    for key in sorted(set(ta) | set(tb)):
        if key not in ta or key not in tb:
            diffs.append(f"tensor {key}: only in {'base' if key in ta else 'head'}")
        elif ta[key] != tb[key]:
            diffs.append(f"tensor {key}: bytes differ")
    shards_a = {p.name for p in a.glob("*.safetensors")}
    for name in sorted(shards_a & {p.name for p in b.glob("*.safetensors")}):
        if (a / name).read_bytes() != (b / name).read_bytes():
            diffs.append(f"shard {name}: file bytes differ")
    files_a = {p.name for p in a.iterdir() if p.is_file() and not p.name.endswith(".safetensors")}
    files_b = {p.name for p in b.iterdir() if p.is_file() and not p.name.endswith(".safetensors")}
    for name in sorted(files_a ^ files_b):
        diffs.append(f"file {name}: only in {'base' if name in files_a else 'head'}")
    for name in sorted(files_a & files_b):
        if name == "model.safetensors.index.json":
            # Which shard holds a tensor may change with the writer; the tensors themselves are compared above.
            wa = json.loads((a / name).read_text())["weight_map"]
            wb = json.loads((b / name).read_text())["weight_map"]
            if set(wa) != set(wb):
                diffs.append(f"file {name}: different key sets")
        elif name.endswith(".json"):
            if json.loads((a / name).read_text()) != json.loads((b / name).read_text()):
                diffs.append(f"file {name}: JSON differs")
        elif (a / name).read_bytes() != (b / name).read_bytes():
            diffs.append(f"file {name}: bytes differ")
    return diffs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="main", help="revision to compare against (default: main)")
    p.add_argument("--head", default=None, help="revision to check (default: the working tree)")
    p.add_argument("--only", nargs="*", default=None, help=f"configurations to run: {[c.name for c in MATRIX]}")
    p.add_argument("--scratch", type=Path, default=None, help="keep worktrees and exports here")
    args = p.parse_args(argv)
    configs = [c for c in MATRIX if args.only is None or c.name in args.only]
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="export-identity-"))
    scratch.mkdir(parents=True, exist_ok=True)
    base_tree, head_tree = _checkout(args.base, scratch), _checkout(args.head, scratch)
    failures = 0
    for cfg in configs:
        ckpt = _make_checkpoint(base_tree, scratch, cfg.model)
        results = {}
        for side, tree in (("base", base_tree), ("head", head_tree)):
            out = scratch / side / cfg.name
            shutil.rmtree(out, ignore_errors=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            results[side] = (_run(tree, scratch, ckpt, cfg, out), out)
        (ok_a, log_a), out_a = results["base"]
        (ok_b, log_b), out_b = results["head"]
        if not ok_a or not ok_b:
            failures += not ok_b  # a configuration the base cannot run is not the head's fault
            which = "base" if not ok_a else "head"
            print(f"{cfg.name:<20} {which} FAILED\n{(log_a if not ok_a else log_b)}")
            continue
        diffs = compare(out_a, out_b)
        failures += bool(diffs)
        print(f"{cfg.name:<20} {'identical' if not diffs else f'{len(diffs)} difference(s)'}")
        for line in diffs[:20]:
            print(f"    {line}")
    print(f"scratch: {scratch}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
