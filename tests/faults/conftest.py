"""Fixtures of the fault set (helpers live in ``faults/helpers.py``)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _unpatched(restore_remote_code):
    """Each fault test leaves the remote code unpatched (hf_ptq's load patches it process-wide)."""
    yield


@pytest.fixture
def run_tool(capsys):
    """``run_tool("ptq" | "convert", argv) -> (exit code, stdout, stderr)``, in this process."""

    def run(tool: str, argv: list[str]) -> tuple[int, str, str]:
        if tool == "ptq":
            from modelopt_k3.cli.hf_ptq import main
        else:
            from modelopt_k3.cli.convert import main
        capsys.readouterr()
        rc = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return rc, out, err

    return run
