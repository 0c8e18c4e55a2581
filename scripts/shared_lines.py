"""Count the statements of our Python files that coincide with a reference (public) file.

    python scripts/shared_lines.py OURS REFERENCE [--min-run 4] [--show]

OURS and REFERENCE are each a .py file or a folder (searched recursively for .py files). Both sides are
normalized: comments, docstrings and blank lines dropped, white space removed, lines made only of brackets
and commas dropped. Two views are compared, physical lines and logical statements (a wrapped call
joined into one), and for each of our files the larger count is reported: the number of our
*non-declarative* lines that sit inside a run of >= --min-run consecutive lines equal to consecutive
lines of some reference file. Declarative lines (imports, def/class headers, decorators, parameter lines,
keyword-argument lines, plain `self.x = y` field assignments) may coincide and are not counted, but they
do count toward a run's length. Exit status 0; the figures are printed.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from collections import defaultdict
from pathlib import Path

_PUNCT_ONLY = re.compile(r"^[()\[\]{},:]*$")
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = rf"{_NAME}(\.{_NAME})*"
_SIMPLE = rf"({_DOTTED}|-?[0-9.e+-]+|True|False|None|'[^']*'|\"[^\"]*\")"
_DECLARATIVE = [
    re.compile(r"^(import|from)[A-Za-z_.]"),  # white space is gone: `fromximporty`
    re.compile(r"^(asyncdef|def|class)[A-Za-z_]|^@"),
    re.compile(r"^\)(->.*)?:$"),  # the end of a signature
    re.compile(rf"^\*{{0,2}}{_NAME}(:[^=]+)?(={_SIMPLE})?,?$"),  # a parameter or a bare name in a list
    re.compile(rf"^{_NAME}={_SIMPLE},?$"),  # a keyword argument
    re.compile(rf"^self\.{_NAME}={_SIMPLE}$"),  # a field assignment
    re.compile(rf"^self\.{_NAME}=getattr\({_NAME},{_SIMPLE}(,{_SIMPLE})?\)$"),
    re.compile(rf"^{_NAME}=(\[[^\[\]()=]*\]|{_SIMPLE}|[\[{{]|\[[^\[\]()=]*)$"),  # a class attribute: constant or list
    re.compile(r"^super\(\)\.__init__\((.*\))?$"),
    re.compile(r"^(else|try|finally|pass|return|continue|break):?$"),
    re.compile(r"^[\"'][^\"']*[\"'][:,]?.*,?$"),  # a string item of a list or dict literal
]


def is_declarative(line: str) -> bool:
    return any(p.match(line) for p in _DECLARATIVE)


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def normalize(source: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(physical, logical): lists of (first source line number, normalized text)."""
    try:
        doc = _docstring_lines(ast.parse(source))
    except SyntaxError:  # a file that does not parse (one vendored copy): compare without docstrings dropped
        doc = set()
    physical: dict[int, list[str]] = defaultdict(list)
    logical: list[tuple[int, str]] = []
    current: list[str] = []
    start = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING):
            continue
        if tok.type == tokenize.STRING and tok.start[0] in doc:
            continue
        if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            if current:
                logical.append((start, "".join(current)))
            current = []
            continue
        if not current:
            start = tok.start[0]
        current.append(tok.string)
        physical[tok.start[0]].append(tok.string)
    phys = [(n, "".join(parts)) for n, parts in sorted(physical.items())]
    keep = lambda items: [(n, s) for n, s in items if s and not _PUNCT_ONLY.match(s)]  # noqa: E731
    return keep(phys), keep(logical)


Index = dict[str, list[tuple[int, int]]]


def build_index(ref_lines: list[list[str]]) -> Index:
    """normalized line -> every (reference file, position) holding it."""
    where: Index = defaultdict(list)
    for r, lines in enumerate(ref_lines):
        for j, s in enumerate(lines):
            where[s].append((r, j))
    return where


def shared_runs(ours: list[str], where: Index, min_run: int) -> set[int]:
    """Indices of `ours` inside a run of >= min_run consecutive lines also consecutive in one reference."""
    marked: set[int] = set()
    prev: dict[tuple[int, int], int] = {}
    for i, s in enumerate(ours):
        cur = {(r, j): prev.get((r, j - 1), 0) + 1 for r, j in where.get(s, ())}
        for length in cur.values():
            if length >= min_run:
                marked.update(range(i - length + 1, i + 1))
        prev = cur
    return marked


def python_files(path: Path) -> list[Path]:
    return sorted(path.rglob("*.py")) if path.is_dir() else [path]


def compare(ours: Path, indexes: tuple[Index, Index], min_run: int) -> tuple[int, list[tuple[int, str]]]:
    """(count, the counted lines) for one file of ours against the indexed reference files."""
    best: tuple[int, list[tuple[int, str]]] = (0, [])
    for lines, where in zip(normalize(ours.read_text()), indexes):  # physical, then logical
        marked = shared_runs([s for _, s in lines], where, min_run)
        counted = [lines[i] for i in sorted(marked) if not is_declarative(lines[i][1])]
        if len(counted) > best[0]:
            best = (len(counted), counted)
    return best


def _normalize_or_skip(path: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    try:
        return normalize(path.read_text(errors="replace"))
    except (tokenize.TokenError, SyntaxError):  # a reference file that does not even tokenize
        print(f"skipped (does not tokenize): {path}", file=sys.stderr)
        return [], []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ours", type=Path)
    parser.add_argument("reference", type=Path)
    parser.add_argument("--min-run", type=int, default=4)
    parser.add_argument("--show", action="store_true", help="print each counted line")
    args = parser.parse_args(argv)
    refs = python_files(args.reference)
    views = [_normalize_or_skip(r) for r in refs]
    indexes = tuple(build_index([[s for _, s in v[k]] for v in views]) for k in range(2))
    total = 0
    for path in python_files(args.ours):
        count, lines = compare(path, indexes, args.min_run)
        total += count
        if count:
            print(f"{count:5d}  {path}")
            if args.show:
                for n, s in lines:
                    print(f"         {n:5d}: {s[:150]}")
    print(f"{total:5d}  total non-declarative lines in runs of >= {args.min_run} shared lines ({len(refs)} reference files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
