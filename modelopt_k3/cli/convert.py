"""``modelopt-k3-convert``: calibration-free streaming conversion of an MXFP4 checkpoint, shard by shard.

    modelopt-k3-convert --src CKPT --dst OUT [--recipe RECIPE] [--trust_remote_code] [--rank R --world_size W]

Without ``--recipe`` the model's calibration-free recipe (its spec's ``RecipesSpec.converter``) is used: the
routed experts become NVFP4 by the lossless cast and every other tensor stays as the source stores it
(Kimi-K3: ``models/moonshotai/Kimi-K3/nvfp4_experts``, GPT-OSS: ``models/openai/gpt-oss/nvfp4_experts``;
DeepSeek-V3: ``models/deepseek-ai/DeepSeek-V3/w4a16_nvfp4``, weight-only NVFP4 of its BF16, block-FP8 or INT4
source, decoded as the loader decodes it; Qwen3-MoE has none, its BF16 experts need calibration for NVFP4,
so ``--recipe`` is required).

Ranks split the source shards (shard ``i`` goes to rank ``i % W``); run one process per rank on any
machines that share ``OUT``. Under ``torchrun`` the rank and world size come from its environment
and the ranks meet in a (gloo) process group, so rank 0 finalizes after the others; independent
processes coordinate through the completion records in ``OUT`` and the last to finish finalizes.
A rerun resumes: completed shards are kept, partial ones redone; a rerun over a complete output of
the same job has nothing to do and exits 0. Refusals print one line and exit 2 (``--debug``: with
the traceback); SIGTERM removes the shard being written and exits 143. The process that finalizes
prints ``modelopt-k3-check``'s table; with ``--target_engines`` a recipe a named engine cannot serve is
refused up front, and the exit status is 1 when a named engine would not serve the output as converted.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

from ._common import converter_recipe, non_negative_int, positive_int, run_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="modelopt-k3-convert",
        description="Convert an MXFP4 Kimi-K3-class checkpoint to a ModelOpt NVFP4/FP8 checkpoint without "
        "calibration, one shard at a time, never building the model.",
    )
    p.add_argument("--src", type=Path, required=True, help="source checkpoint directory")
    p.add_argument("--dst", type=Path, required=True, help="output directory (written in place; resumable)")
    p.add_argument("--recipe", default=None,
                   help="YAML recipe path or name (needs no calibration; default: the model's calibration-free "
                   "recipe, e.g. models/moonshotai/Kimi-K3/nvfp4_experts)")
    p.add_argument("--rank", type=non_negative_int, default=None, help="this process's rank (default: $RANK or 0)")
    p.add_argument("--world_size", type=positive_int, default=None,
                   help="number of ranks (default: $WORLD_SIZE or 1)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a complete output, another job's partial output or foreign files in --dst")
    p.add_argument("--no_resume", action="store_true", help="rewrite this rank's shards even if complete")
    p.add_argument("--no_verify", action="store_true",
                   help="on resume trust a completed shard's recorded size instead of re-hashing it, and the "
                   "source's file sizes and modification times instead of re-hashing the source bytes it was made from")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="threads converting one shard's tensors (default: min(4, CPU count))")
    p.add_argument("--finalize", action="store_true",
                   help="only finalize (index, configs, marker) an output whose shards are all complete")
    p.add_argument("--trust_remote_code", action="store_true",
                   help="run the checkpoint's own modeling code: build the model on the meta device to check every "
                   "dense tensor against it, as hf_ptq does (without it only the routed experts are checked against "
                   "config.json), and probe a tiny configuration for the Linears that read one input (needed by "
                   "recipes that give dense Linears NVFP4)")
    p.add_argument("--allow_nonfinite_passthrough", action="store_true",
                   help="copy tensors with NaN/Inf that stay unquantized unchanged (with a warning) instead of refusing")
    p.add_argument("--target_engines", default=None, metavar="ENGINES",
                   help="comma-separated serving engines (vllm, sglang, trtllm) the output must load in as converted: "
                        "a recipe one of them cannot serve is refused before anything is written, and the exit "
                        "status is 1 when the final modelopt-k3-check finds one of them does not load it correctly")
    p.add_argument("--allow_unmatched", action="store_true",
                   help="run even if a recipe pattern matches no module of the checkpoint (refused by default: a typo)")
    p.add_argument("--debug", action="store_true", help="print the traceback of an expected failure too")
    p.add_argument("--no_progress", action="store_true")
    return p


def _under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and bool(os.environ.get("MASTER_ADDR"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli("modelopt-k3-convert", lambda: _run(args), debug=args.debug)


def _run(args: argparse.Namespace) -> int:
    from ..check import check_recipe_for_engines, final_check, parse_engines
    from ..convert import convert_checkpoint, finalize_conversion
    from ..recipe import load_recipe

    recipe_name = args.recipe or converter_recipe(args.src)
    args.recipe = load_recipe(recipe_name, overrides={"allow_unmatched": True} if args.allow_unmatched else None)

    targets = parse_engines(args.target_engines) if args.target_engines else ()
    if targets:  # before anything is read or written: names and headers only
        check_recipe_for_engines(args.src, args.recipe, targets)
    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", "0"))
    world_size = args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if args.finalize:
        stats = finalize_conversion(args.src, args.dst, args.recipe, trust_remote_code=args.trust_remote_code)
        print(f"modelopt_k3 convert: finalized {args.dst}")
        print("\n".join(stats.lines("  ")))
        return final_check(args.dst, targets, source=args.src)
    kwargs = dict(
        rank=rank,
        world_size=world_size,
        resume=not args.no_resume,
        overwrite=args.overwrite,
        verify=not args.no_verify,
        workers=args.workers,
        progress=not args.no_progress and sys.stderr.isatty(),
        trust_remote_code=args.trust_remote_code,
        allow_nonfinite_passthrough=args.allow_nonfinite_passthrough,
    )
    if _under_torchrun():
        from ..dist.group import run_group

        # gloo: the ranks only exchange small objects and failure flags, never tensors on a GPU.
        try:
            with run_group(backend="gloo"):
                report = convert_checkpoint(args.src, args.dst, args.recipe, **kwargs)
        finally:
            # A process-group object still referenced at interpreter exit is destroyed during
            # teardown, where gloo aborts the process ("terminate called without an active
            # exception"): drop every reference (cycles included) while Python still runs.
            gc.collect()
    else:
        report = convert_checkpoint(args.src, args.dst, args.recipe, **kwargs)
    print(report.summary())
    # The process that finalized the output checks it (the others' shards are part of it).
    return final_check(args.dst, targets, source=args.src) if report.finalized else 0


if __name__ == "__main__":
    sys.exit(main())
