"""Owner records (ownership.py) decided by hand: this host's owners by pid, boot and start time; another
host's by the age of its heartbeat against the stale limit."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from modelopt_k3.files.locks import STALE_AFTER_ENV, Owner, owner_status, read_record, write_record


@pytest.fixture
def record(tmp_path, monkeypatch):
    monkeypatch.setenv(STALE_AFTER_ENV, "600")
    path = tmp_path / "owner.json"
    write_record(path, Owner.this_process())
    return path


def _aged(path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_another_hosts_owner_is_alive_until_its_heartbeat_is_older_than_the_limit(record):
    other = replace(Owner.this_process(), host="another-host.example", boot_id="b")
    _aged(record, 30)
    assert owner_status(other, record)[0] is True
    _aged(record, 599)
    assert owner_status(other, record)[0] is True
    _aged(record, 601)
    alive, why = owner_status(other, record)
    assert alive is False and why.startswith("no heartbeat from another-host.example for 601 s (> 600 s")
    record.unlink()
    assert owner_status(other, record) == (False, "its record is gone")


def test_this_hosts_owner_by_pid_boot_and_start_time(record):
    me = Owner.this_process()
    assert owner_status(me, record) == (True, "this process")
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    dead = replace(me, pid=proc.pid)
    assert owner_status(dead, record)[0] is False
    parent = replace(me, pid=os.getppid(), start_ticks=None)  # runs; its start time unknown: alive
    assert owner_status(parent, record)[0] is True
    reused = replace(me, pid=os.getppid(), start_ticks="1")  # the pid now names another process
    assert owner_status(reused, record) == (False, f"pid {os.getppid()} on {me.host} now belongs to another process")
    if me.boot_id is not None:
        rebooted = replace(me, boot_id="an-earlier-boot")
        assert owner_status(rebooted, record) == (False, f"{me.host} has rebooted since")


def test_a_record_round_trips_and_an_unreadable_one_is_none(record):
    owner, data = read_record(record)
    assert owner == Owner.this_process().__class__(**{k: data[k] for k in ("pid", "host", "boot_id", "start_ticks",
                                                                          "created")})
    assert owner.pid == os.getpid()
    record.write_text("{")
    assert read_record(record) is None
