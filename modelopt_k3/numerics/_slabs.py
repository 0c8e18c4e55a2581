"""Row-slab execution of the CPU kernels: cache-friendly temporaries, no OpenMP barriers.

The numerics are chains of ~10 vectorized torch ops. Run over a whole 3072x3584 matrix, each op
streams 44 MB temporaries through memory (and page-faults them in); run over row slabs of
``SLAB_ELEMS`` elements, the temporaries stay in cache and the chain is several times faster.

Slabs are also the unit of parallelism. A small pool of dedicated worker threads, each with
torch's intra-op parallelism set to 1 for itself, takes slabs from a shared queue (torch ops
release the GIL). With one OpenMP parallel region per op instead, every op ends in a barrier,
and on a busy machine (another process holding a core) each barrier waits for a descheduled
thread: a chain of a few hundred small ops then runs ~10x slower. Workers never wait for each
other, so load only slows the work down by the share of CPU it takes.

torch keeps the thread count in a process-wide value that each thread copies once, when it first
asks for it; a worker makes that copy, then calls ``torch.set_num_threads(1)`` (its own copy and
the process-wide value), and the pool's creator restores the process-wide value right after (its
own copy never changed). ``tests/numerics/test_numerics.py`` checks both. Other
devices run the whole tensor as one slab on the calling thread. The loop is over large row slabs,
never over quantization blocks or elements.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

SLAB_ELEMS = 1 << 18
USE_POOL = True  # False: run the slabs on the calling thread (torch's own intra-op threads)

_THREAD_PREFIX = "modelopt_k3_numerics"
_POOL: ThreadPoolExecutor | None = None
_POOL_WORKERS = 0
_POOL_PID = 0  # a forked child inherits the pool object but not its threads: it makes its own
_POOL_LOCK = threading.Lock()


def _single_threaded_worker(started: threading.Barrier) -> None:
    torch.get_num_threads()  # run torch's once-per-thread init now, so it cannot undo the next line later
    torch.set_num_threads(1)
    started.wait()


def _pool(workers: int) -> ThreadPoolExecutor:
    """The shared pool of ``workers`` single-threaded torch workers (created on first use)."""
    global _POOL, _POOL_WORKERS, _POOL_PID
    with _POOL_LOCK:
        if _POOL is None or workers > _POOL_WORKERS or os.getpid() != _POOL_PID:
            if _POOL is not None and os.getpid() == _POOL_PID:
                _POOL.shutdown(wait=False)
            threads = torch.get_num_threads()
            started = threading.Barrier(workers + 1)
            pool = ThreadPoolExecutor(
                max_workers=workers,
                thread_name_prefix=_THREAD_PREFIX,
                initializer=_single_threaded_worker,
                initargs=(started,),
            )
            for _ in range(workers):  # start every worker now, so each runs its initializer
                pool.submit(lambda: None)
            started.wait()
            torch.set_num_threads(threads)  # restore the process-wide value the workers lowered
            _POOL, _POOL_WORKERS, _POOL_PID = pool, workers, os.getpid()
        return _POOL


def row_slabs(n_rows: int, row_len: int, device: torch.device) -> list[slice]:
    """Slices of rows covering ``range(n_rows)``: one slice off CPU, ~SLAB_ELEMS elements each on CPU."""
    if device.type != "cpu" or n_rows * row_len <= SLAB_ELEMS:
        return [slice(0, n_rows)]
    step = max(1, SLAB_ELEMS // max(row_len, 1))
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


def run_slabs(n_rows: int, row_len: int, device: torch.device, fn: Callable[[slice], None]) -> None:
    """Call ``fn(rows)`` for row slabs covering ``range(n_rows)`` (on CPU: in the worker pool).

    ``fn`` must only write its own rows of preallocated outputs. It runs under ``torch.no_grad()``.
    """
    slabs = row_slabs(n_rows, row_len, device)
    threads = torch.get_num_threads()
    if (
        not USE_POOL
        or device.type != "cpu"
        or threads <= 1
        or threading.current_thread().name.startswith(_THREAD_PREFIX)
    ):
        with torch.no_grad():
            for sl in slabs:
                fn(sl)
        return

    workers = min(threads, len(slabs))
    queue = iter(slabs)
    lock = threading.Lock()

    def drain() -> None:
        with torch.no_grad():
            while True:
                with lock:
                    sl = next(queue, None)
                if sl is None:
                    return
                fn(sl)

    pool = _pool(threads)
    futures = [pool.submit(drain) for _ in range(workers)]
    for f in futures:
        f.result()
