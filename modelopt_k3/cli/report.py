"""``modelopt-k3-report EXPORT [--out DIR]``: re-render a quantization report from its ``report.json``.

EXPORT is an export directory holding ``quant_report/``, a report directory, or a ``report.json``.
Writes ``report.md`` and the PNG plots next to the JSON (or into ``--out``) and prints the summary
lines. Exit status 0, or 2 when there is no report or it is not one this version reads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="modelopt-k3-report",
                                description="Re-render report.md and the plots of a quantization report from report.json.")
    p.add_argument("path", type=Path, help="export directory, report directory or report.json")
    p.add_argument("--out", type=Path, default=None, help="write here instead of next to report.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..files.paths import DestinationError
    from ..report import check_report_dir, load_report
    from ..report.render import render

    try:
        data, where = load_report(args.path)
        out = args.out or where
        check_report_dir(out, flag="--out" if args.out else "the report directory")  # before any rendering
        try:
            written = render(data, out)
        except (TypeError, KeyError, AttributeError, IndexError) as exc:  # a field of the wrong type or missing
            raise ValueError(f"{where} is not a report this version reads: {type(exc).__name__}: {exc}") from None
    except (OSError, ValueError, DestinationError) as exc:
        print(f"modelopt-k3-report: error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
