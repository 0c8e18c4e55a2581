"""What every command line entry point shares: argument types, SIGTERM handling, and how failures end.

Expected failures (bad input, a refused checkpoint or destination, a rank that failed a collective
step) end with one line per group of ranks that failed the same way, printed once (by rank 0 when the
ranks agreed), and exit code 2 on every rank; ``--debug`` adds the traceback. Anything else is a bug:
its traceback is printed and the exit code is 1. SIGTERM (what torchrun sends the surviving ranks
when one dies) becomes ``Terminated``, a ``SystemExit`` that unwinds the stack, so context managers
remove their temporary data; the exit code is 128 + 15. SIGINT (Ctrl-C) unwinds the same way as
``KeyboardInterrupt`` and exits 128 + 2, with one line. An ``OSError`` of the environment (disk full,
read-only filesystem, a path component that is a file, no permission) is a refusal too: one line
naming the file, exit 2. At exit, the heap is frozen before the interpreter tears it down (``gc.freeze``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import gc
import signal
import sys
import traceback
from collections.abc import Callable, Iterator

EXIT_REFUSED = 2
# The interpreter's shutdown collects garbage over every object torch and transformers left alive (millions):
# ~0.5 s of each run's exit, collecting nothing a finished process needs. Frozen objects are skipped; atexit
# callbacks registered later (file, process-group and tqdm cleanup) run before this one and are unaffected.
atexit.register(gc.freeze)
EXIT_TERMINATED = 128 + signal.SIGTERM
EXIT_INTERRUPTED = 128 + signal.SIGINT
# What the machine, not the program, gets wrong: reported in one line, like any refusal.
ENVIRONMENT_ERRNOS = frozenset({
    errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM,
    errno.ENAMETOOLONG, errno.EMFILE, errno.ENFILE, errno.EIO, errno.ELOOP, errno.EXDEV, errno.ENOENT,
})


class Terminated(SystemExit):
    """SIGTERM arrived; raised once in the main thread so that cleanup code runs."""


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    """A finite number above 0 (memory sizes, bandwidths)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text} is out of range: must be a finite number > 0")
    return value


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} is out of range: must be >= {low}")
    return value


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While active, the first SIGTERM raises ``Terminated`` (later ones are ignored: cleanup runs)."""
    fired = False

    def handler(signum, frame) -> None:
        nonlocal fired
        if fired:
            return
        fired = True
        raise Terminated(EXIT_TERMINATED)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (e.g. called from a worker thread): leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def expected_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "refused": the message says what to fix, a traceback adds nothing."""
    from ..checkpoint import CheckpointError
    from ..convert import ConvertError
    from ..dist.collectives import DistributedStepError
    from ..load import LoadError
    from ..quant.quantizer import QuantizerError
    from ..spec import SpecError

    return (ValueError, FileExistsError, PermissionError, CheckpointError, ConvertError, DistributedStepError,
            LoadError, SpecError, QuantizerError)


def failure_lines(exc: BaseException) -> list[str] | None:
    """One line per group of ranks that failed alike; None when this rank should print nothing.

    A step the ranks agreed on is printed by rank 0 only; an error raised outside such a step (or
    when the ranks could not agree, e.g. a peer died) is printed by the rank that saw it.
    """
    from ..dist.collectives import DistributedStepError

    if not isinstance(exc, DistributedStepError) or not exc.failures:
        return [_one_line(str(exc))]
    if exc.rank != 0:
        return None
    by_message: dict[str, list[int]] = {}
    for rank, message in exc.failures.items():
        by_message.setdefault(message, []).append(rank)
    lines = []
    for message, ranks in by_message.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"
        lines.append(_one_line(f"{exc.step} failed on {who}: {message}"))
    if exc.note:
        lines.append(_one_line(exc.note))
    return lines


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _os_error_line(exc: OSError) -> str:
    where = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
    why = exc.strerror or str(exc)
    hint = {errno.ENOSPC: "free space or choose another output directory", errno.EDQUOT: "free quota",
            errno.EROFS: "choose a writable output directory", errno.ENOTDIR: "a component of the path is a file"}
    tip = f"; {hint[exc.errno]}" if exc.errno in hint else ""
    return f"{why}{f': {where}' if where else ''}{tip}"


def _temporary_data() -> str:
    """What became of this process's temporary export data, truly: removed, or where it was left."""
    from ..export.staging import discard_live

    left = discard_live()
    if not left:
        return "temporary data removed"
    return (f"temporary data left at {', '.join(map(str, left))} (the next run to this export path removes it, "
            "or puts a moved-aside export back)")


def run_cli(prog: str, body: Callable[[], int], *, debug: bool = False) -> int:
    """Run ``body`` under SIGTERM unwinding; turn expected failures into one line and exit code 2."""
    try:
        with sigterm_unwinds():
            return body()
    except Terminated:
        print(f"{prog}: terminated (SIGTERM); {_temporary_data()}", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (SIGINT); {_temporary_data()}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except expected_errors() as exc:
        if debug:
            traceback.print_exc()
        lines = failure_lines(exc)
        for line in lines or ():
            print(f"{prog}: error: {line}", file=sys.stderr)
        return EXIT_REFUSED
    except OSError as exc:
        if exc.errno not in ENVIRONMENT_ERRNOS:
            raise
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {_one_line(_os_error_line(exc))}", file=sys.stderr)
        return EXIT_REFUSED


def converter_recipe(ckpt) -> str:
    """The converter's recipe without ``--recipe``: the checkpoint's model's calibration-free one
    (``RecipesSpec.converter``; ``SpecError`` naming why and the fix when the model has none)."""
    from ..checkpoint import read_config
    from ..spec import get_spec

    return get_spec(str(read_config(ckpt).get("model_type", ""))).converter_recipe()
