"""``modelopt-k3-report EXPORT [--out DIR]``: re-render a quantization report from its ``report.json``;
``modelopt-k3-report --compare A B [--out DIR]``: two reports of one checkpoint side by side.

EXPORT (and A, B) is an export directory holding ``quant_report/``, a report directory, or a ``report.json``.
Re-rendering writes ``report.md`` and the PNG plots next to the JSON (or into ``--out``) and prints the
files written. ``--compare`` prints a Markdown table of the weight error per module, the hidden-state error
per decoder layer and the KL, of A and B with the ratio B/A (``report/compare.py``); with ``--out`` it writes
``compare.md``, ``compare.json`` and ``compare.png`` there instead. Exit status 0, or 2 with a one-line
error when there is no report, it is not one this version reads, or A and B are not of the same
checkpoint and modules.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROG = "modelopt-k3-report"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Re-render report.md and the plots of a quantization report "
                                "from report.json, or compare two reports (--compare A B).")
    p.add_argument("path", type=Path, nargs="?", default=None, help="export directory, report directory or report.json")
    p.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"), default=None,
                   help="compare report B with report A (each an export, report directory or report.json): "
                        "weight error per module, hidden-state error per layer and KL, with B/A")
    p.add_argument("--any_checkpoint", action="store_true",
                   help="with --compare: accept reports whose run.checkpoint paths differ (the same model stored twice)")
    p.add_argument("--out", type=Path, default=None,
                   help="write here instead of next to report.json (with --compare: compare.md, compare.json, "
                        "compare.png here instead of the table on stdout)")
    return p


def _fail(message: object) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _load(path: Path, side: str):
    from ..report import load_report

    try:
        return load_report(path)
    except (OSError, ValueError) as exc:  # missing, unreadable, not JSON, not a report: say which side
        raise ValueError(f"{side}: {exc}") from None


def _compare(args) -> int:
    from ..files.paths import OWNED_RECORD, DestinationError, check_owned_dir, write_owned
    from ..report.compare import COMPARE_FILES, compare, compare_files, markdown

    a_path, b_path = args.compare
    try:
        if args.out is not None:
            check_owned_dir(args.out, (*COMPARE_FILES, OWNED_RECORD), flag="--out")  # before any reading
        (a, where_a), (b, where_b) = _load(a_path, "A"), _load(b_path, "B")
        try:
            result = compare(a, b, a_path=str(where_a), b_path=str(where_b), any_checkpoint=args.any_checkpoint)
        except (TypeError, KeyError, AttributeError, IndexError) as exc:  # a field of the wrong type or missing
            raise ValueError(f"A ({where_a}) or B ({where_b}) is not a report this version reads: "
                             f"{type(exc).__name__}: {exc}") from None
        if args.out is None:
            sys.stdout.write(markdown(result))
            return 0
        written = write_owned(args.out, compare_files(result), flag="--out")
    except (OSError, ValueError, DestinationError) as exc:
        return _fail(exc)
    for path in written:
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.path is None) == (args.compare is None):
        parser.error("give one report PATH to re-render, or --compare A B")
    if args.any_checkpoint and args.compare is None:
        parser.error("--any_checkpoint goes with --compare")
    if args.compare is not None:
        return _compare(args)
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
        return _fail(exc)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
