"""Run ``hf_ptq`` or ``modelopt-k3-convert`` with one fault injected, for ``tests/faults``.

    FAULT=<signal>@<where>[:rank<r>] RC_DIR=<dir> python _driver.py {ptq|convert} ARGS...

``signal``: ``kill`` (SIGKILL) or ``term`` (SIGTERM) sent to this process by itself, or ``stall``
(sleep until a signal ends the process; writes ``RC_DIR/stalled`` first); ``where``:
``calib`` (after the first calibration batch), ``export`` (when the export writes its first tensor),
``convert`` (when the converter produces its second module), ``staging`` (once the ranks agreed that rank 0
made the export's staging directory, before its path reaches them). Only on rank ``r`` when given. The exit
code this process returns is written to ``RC_DIR/rank<RANK>.rc`` (a process killed outright writes
nothing), so a test learns every rank's exit code even under torchrun.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def _arm(sig: int | None, where: str) -> None:
    fire = [True]

    def maybe_fire() -> None:
        if fire[0]:
            fire[0] = False
            if sig is None:
                (Path(os.environ["RC_DIR"]) / "stalled").write_text(str(os.getpid()))
                time.sleep(600)
            else:
                os.kill(os.getpid(), sig)

    if where == "export":
        from modelopt_k3.export import writer

        add = writer.ShardWriter.add

        def add_then_fault(self, name, tensor):
            add(self, name, tensor)
            maybe_fire()

        writer.ShardWriter.add = add_then_fault
    elif where == "calib":
        import modelopt_k3.data as data

        make = data.make_forward_loop

        def make_faulty(batches, **kwargs):
            loop = make(batches[:1], **kwargs)

            def forward_loop(model) -> None:
                loop(model)
                maybe_fire()
                make(batches, **kwargs)(model)

            return forward_loop

        data.make_forward_loop = make_faulty
    elif where == "staging":
        from modelopt_k3.export import writer

        together = writer.run_together

        def together_then_fault(what, *args, **kwargs):
            result = together(what, *args, **kwargs)
            if what == "create export dir":
                maybe_fire()
            return result

        writer.run_together = together_then_fault
    elif where == "convert":
        from modelopt_k3.convert import shard

        tensors, calls = shard._ShardConverter.tensors, [0]

        def tensors_then_fault(self, job):
            calls[0] += 1
            if calls[0] == 2:
                maybe_fire()
            return tensors(self, job)

        shard._ShardConverter.tensors = tensors_then_fault
    else:
        raise SystemExit(f"unknown fault site {where!r}")


def arm(fault: str) -> None:
    """Install ``fault`` (``<signal>@<where>[:rank<r>]``, see above) in this process."""
    if fault:
        what, _, rest = fault.partition("@")
        where, _, who = rest.partition(":")
        if not who or who == f"rank{os.environ.get('RANK', '0')}":
            _arm({"kill": signal.SIGKILL, "term": signal.SIGTERM, "stall": None}[what], where)


def run_tool(tool: str, argv: list[str]) -> int:
    if tool == "ptq":
        from modelopt_k3.cli.hf_ptq import main as run
    else:
        from modelopt_k3.cli.convert import main as run
    return run([str(a) for a in argv])


def in_rank(tool: str, argv: list[str], fault: str, err_dir: str) -> int:
    """``tests/_mp.run_ranks`` target: one rank of a run with ``fault``; its stderr goes to ``err_dir``."""
    import contextlib

    arm(fault)
    with open(Path(err_dir) / f"rank{os.environ['RANK']}.err", "w") as err, contextlib.redirect_stderr(err):
        return run_tool(tool, argv)


def stalled_convert(argv: list[str], rc_dir: str) -> int:
    """A converter run that stalls at its second module until a signal ends it (a live lock holder)."""
    os.environ["RC_DIR"] = rc_dir
    arm("stall@convert")
    rc = 1
    try:
        rc = run_tool("convert", argv)
    finally:
        (Path(rc_dir) / "rank0.rc").write_text(str(rc))
    return rc


def main() -> int:
    tool, argv = sys.argv[1], sys.argv[2:]
    arm(os.environ.get("FAULT", ""))
    rc = 1
    try:
        rc = run_tool(tool, argv)
    finally:
        rc_dir = os.environ.get("RC_DIR")
        if rc_dir:
            (Path(rc_dir) / f"rank{os.environ.get('RANK', '0')}.rc").write_text(str(rc))
    return rc


if __name__ == "__main__":
    sys.exit(main())
