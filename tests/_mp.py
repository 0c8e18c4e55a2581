"""Run a function (or a script) on N local ranks with a torchrun-like environment.

    from _mp import run_ranks
    results = run_ranks(2, my_module_level_fn, arg1, timeout=60, env={"MODELOPT_K3_DIST_TIMEOUT": "10"})
    assert [r.exitcode for r in results] == [0, 0], results
    results[1].value  # what my_module_level_fn returned on rank 1

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
(a free port) as torchrun would set them, so the code under test calls ``init_run_group``
exactly as in production. Unlike torchrun, a failing rank does not make the launcher kill
its peers: each rank's own outcome is reported, which is what fail-together tests check.

Functions run in processes forked from a forkserver that has imported torch once (a fresh
``spawn`` costs ~1.5 s of torch import per rank). They must be importable (module level);
a calling script (not pytest) needs the usual ``if __name__ == "__main__":`` guard.
A script path (str/Path ending in .py) instead runs ``python script *args`` per rank.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_CTX = mp.get_context("forkserver")
# transformers too: every rank worker imports it (tens of seconds per rank on a loaded machine, paid once here).
_CTX.set_forkserver_preload(["torch", "torch.distributed", "safetensors.torch", "transformers.modeling_utils"])


@dataclass
class RankResult:
    rank: int
    exitcode: int | None  # None: killed by the launcher at the timeout
    value: Any = None  # the function's return value (function targets)
    error: str | None = None  # "ExceptionType: message" if the function raised
    traceback: str | None = None
    output: str = ""  # stdout+stderr (script targets)
    wall_s: float = 0.0  # from launch until the launcher saw the process end

    @property
    def timed_out(self) -> bool:
        return self.exitcode is None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, n: int, port: int, extra: dict[str, str] | None) -> dict[str, str]:
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(n),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(n),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    env.update(extra or {})
    return env


def _child(fn: Callable, args: tuple, env: dict[str, str], result_path: str) -> None:
    os.environ.update(env)
    try:
        value = fn(*args)
    except BaseException as exc:
        payload = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        with open(result_path, "wb") as f:
            pickle.dump(payload, f)
        sys.stderr.write(payload["traceback"])
        sys.stderr.flush()
        os._exit(1)
    with open(result_path, "wb") as f:
        pickle.dump({"value": value}, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip atexit / process-group teardown surprises in forked children


def run_ranks(
    n: int,
    target: Callable | str | Path,
    *args: Any,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> list[RankResult]:
    """Run ``target(*args)`` on ranks 0..n-1 and wait for all of them (killing any left at ``timeout``)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="mp-ranks-") as tmp:
        procs: list[Any] = []
        logs: list[Any] = []
        start = time.monotonic()
        for rank in range(n):
            rank_env = _rank_env(rank, n, port, env)
            if callable(target):
                p = _CTX.Process(
                    target=_child, args=(target, args, rank_env, f"{tmp}/r{rank}.pkl"), daemon=True
                )
                p.start()
            else:
                log = open(f"{tmp}/r{rank}.log", "w+b")  # noqa: SIM115 - closed below
                logs.append(log)
                p = subprocess.Popen(
                    [sys.executable, str(target), *map(str, args)],
                    env={**os.environ, **rank_env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            procs.append(p)

        is_fn = callable(target)
        codes: list[int | None] = [None] * n
        ended: list[float | None] = [None] * n
        while any(t is None for t in ended) and time.monotonic() - start < timeout:
            for rank, p in enumerate(procs):
                if ended[rank] is None:
                    code = p.exitcode if is_fn else p.poll()
                    if code is not None:
                        codes[rank], ended[rank] = code, time.monotonic() - start
            time.sleep(0.02)
        for rank, p in enumerate(procs):  # stragglers past the timeout
            if ended[rank] is None:
                p.kill()
                if is_fn:
                    p.join()
                else:
                    p.wait()
                ended[rank] = time.monotonic() - start

        results = []
        for rank in range(n):
            res = RankResult(rank=rank, exitcode=codes[rank], wall_s=ended[rank])
            if is_fn:
                path = Path(f"{tmp}/r{rank}.pkl")
                if path.exists():
                    payload = pickle.loads(path.read_bytes())
                    res.value = payload.get("value")
                    res.error = payload.get("error")
                    res.traceback = payload.get("traceback")
            else:
                logs[rank].seek(0)
                res.output = logs[rank].read().decode(errors="replace")
                logs[rank].close()
            results.append(res)
        return results
