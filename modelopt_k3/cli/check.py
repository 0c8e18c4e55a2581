"""``modelopt-k3-check EXPORT_DIR [--engine vllm,sglang,trtllm]``: would these engines serve it as calibrated?

Replays each engine's loading of a ModelOpt-format export from headers, configs and small tensors
(``modelopt_k3.check``). Exit status: 0 when every named engine loads it correctly, 1 when one
refuses it or would serve different numbers, 2 on a usage or checkpoint error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="modelopt-k3-check",
        description="Replay vLLM's, SGLang's and TensorRT-LLM's loading of a ModelOpt-format export and say, per "
        "engine, whether it loads correctly, loads but serves different numbers, or refuses.",
    )
    p.add_argument("export_dir", type=Path, help="exported checkpoint directory")
    p.add_argument("--engine", default="vllm,sglang", help="comma-separated: vllm, sglang, trtllm (default: vllm,sglang)")
    p.add_argument("--brief", action="store_true", help="one line per engine, no details")
    p.add_argument("--source", type=Path, default=None,
                   help="the checkpoint the export was made from: its tokenizer, chat template, generation and "
                        "processor configs must be in the export too (default: the one a converter's marker names)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..check import check_export, parse_engines
    from ..checkpoint import CheckpointError

    try:
        report = check_export(args.export_dir, parse_engines(args.engine), source=args.source)
    except (CheckpointError, ValueError) as exc:
        print(f"modelopt-k3-check: error: {exc}", file=sys.stderr)
        return 2
    print(report.table(details=not args.brief))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
