"""``scripts/export_identity.py`` gives every torchrun it starts a port free at that moment (the kernel's pick),
so two comparisons running at once do not meet at one rendezvous (fixed ``29600 + i`` ports did)."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "export_identity.py"


def _script(monkeypatch):
    spec = importlib.util.spec_from_file_location("export_identity_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_each_torchrun_gets_a_port_no_one_holds(monkeypatch, tmp_path: Path) -> None:
    script = _script(monkeypatch)
    ports: list[int] = []

    def run(cmd, **kw):
        port = int(cmd[cmd.index("--master_port") + 1])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # free now: nothing else listens on it
        ports.append(port)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(script.subprocess, "run", run)
    cfg = script.Config("ep2_nvfp4", 2, ())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:  # another comparison's rendezvous
        held.bind(("127.0.0.1", 29600))
        held.listen()
        for _ in range(2):
            assert script._run(tmp_path, tmp_path, tmp_path / "ckpt", cfg, tmp_path / "out")[0]
    assert len(ports) == 2 and 29600 not in ports
