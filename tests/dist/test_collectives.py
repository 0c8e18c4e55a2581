"""Run group and fail-together collectives: world 1 in-process, worlds 2/4 on real gloo ranks."""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch
from _mp import run_ranks

from modelopt_k3.dist import group as group_mod
from modelopt_k3.dist.collectives import (
    DistributedStepError,
    all_gather_object,
    all_reduce_max_,
    barrier,
    broadcast_object,
    run_together,
)
from modelopt_k3.dist.group import current_group, init_run_group, run_group

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def single_process(monkeypatch):
    for name in (*_TORCHRUN_VARS, group_mod.TIMEOUT_ENV):
        monkeypatch.delenv(name, raising=False)
    group_mod.destroy_run_group()
    yield
    group_mod.destroy_run_group()


# --------------------------------------------------------------------------- world size 1


def test_single_process_group(single_process):
    with run_group() as g:
        assert (g.rank, g.world_size, g.local_rank, g.backend, g.pg) == (0, 1, 0, "none", None)
        assert g.is_main
        assert init_run_group() is g  # idempotent
        assert current_group() is g
        assert not torch.distributed.is_initialized()
    assert group_mod._current is None
    assert current_group().world_size == 1  # default without init


def test_wrappers_are_identity_at_world_1(single_process):
    t = torch.tensor([1.0, -2.0])
    assert all_reduce_max_(t) is t and t.tolist() == [1.0, -2.0]
    assert all_gather_object({"a": 1}) == [{"a": 1}]
    assert broadcast_object("x") == "x"
    barrier()
    assert run_together("add", lambda a, b=0: a + b, 2, b=3) == 5


def test_run_together_world_1_reraises_original(single_process):
    def boom():
        raise KeyError("missing-thing")

    with pytest.raises(KeyError, match="missing-thing"):
        run_together("lookup", boom)


def test_world_size_without_master_env_is_refused(single_process, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT not set; launch with `torchrun"):
        init_run_group()


def test_bad_timeout_env_is_refused(single_process, monkeypatch):
    monkeypatch.setenv(group_mod.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="MODELOPT_K3_DIST_TIMEOUT='soon' is not a number"):
        group_mod._default_timeout_s()


def test_step_error_message_and_pickle():
    err = DistributedStepError("load experts", {3: "ValueError: bad", 1: "OSError: disk"}, rank=0)
    assert str(err) == (
        "step 'load experts' failed on ranks 1, 3 (seen from rank 0): rank 1: OSError: disk; rank 3: ValueError: bad"
    )
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.failures == err.failures


# --------------------------------------------------------------------------- real gloo ranks


def _wrappers_worker():
    with run_group() as g:
        assert g.world_size == int(os.environ["WORLD_SIZE"]) and g.backend == "gloo" and g.pg is not None
        t = torch.tensor([float(g.rank), -float(g.rank)])
        all_reduce_max_(t)
        gathered = all_gather_object({"rank": g.rank})
        from_1 = broadcast_object(f"hello from {g.rank}", src=1)
        barrier()
        doubled = run_together("double", lambda x: 2 * x, g.rank)
        return {
            "max": t.tolist(),
            "gathered": gathered,
            "from_1": from_1,
            "doubled": doubled,
            "main": g.is_main,
        }


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4])
def test_wrappers_multi_rank(n):
    results = run_ranks(n, _wrappers_worker, timeout=60)
    assert [r.exitcode for r in results] == [0] * n, [r.traceback for r in results]
    for r in results:
        assert r.value == {
            "max": [float(n - 1), 0.0],
            "gathered": [{"rank": i} for i in range(n)],
            "from_1": "hello from 1",
            "doubled": 2 * r.rank,
            "main": r.rank == 0,
        }


def _fail_on(failing: set[int], message: str):
    rank = current_group().rank
    if rank in failing:
        raise ValueError(f"{message} {rank}")
    return rank


def _one_rank_raises_worker(failing: list[int]):
    with run_group() as g:
        start = time.monotonic()
        try:
            run_together("load experts", _fail_on, set(failing), "bad shard on rank", group=g)
        except DistributedStepError as exc:
            out = {
                "message": str(exc),
                "failures": exc.failures,
                "cause": type(exc.__cause__).__name__ if exc.__cause__ else None,
                "elapsed": time.monotonic() - start,
            }
        else:
            return "did not raise"
        # The group is still in step after a shared failure.
        out["after"] = run_together("next step", lambda: g.rank * 10)
        return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("n, failing", [(2, [1]), (4, [0, 2])])
def test_one_rank_raises_all_raise(n, failing):
    results = run_ranks(n, _one_rank_raises_worker, failing, timeout=60)
    assert [r.exitcode for r in results] == [0] * n, [r.traceback for r in results]
    for r in results:
        v = r.value
        assert isinstance(v, dict), v
        assert v["failures"] == {f: f"ValueError: bad shard on rank {f}" for f in failing}
        noun = "rank" if len(failing) == 1 else "ranks"
        assert v["message"].startswith(
            f"step 'load experts' failed on {noun} {', '.join(map(str, failing))} (seen from rank {r.rank}): "
        )
        assert v["cause"] == ("ValueError" if r.rank in failing else None)
        assert v["elapsed"] < 5
        assert v["after"] == r.rank * 10


def _dies_or_hangs(how: str, hang_s: float):
    if current_group().rank == 1:
        if how == "exit":
            os._exit(3)
        time.sleep(hang_s)
    return "ok"


def _peer_lost_worker(how: str, hang_s: float):
    with run_group() as g:
        start = time.monotonic()
        try:
            run_together("calibrate", _dies_or_hangs, how, hang_s, group=g)
        except DistributedStepError as exc:
            return {"message": str(exc), "elapsed": time.monotonic() - start}
        return "did not raise"


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["exit", "hang"])
def test_lost_peer_raises_within_timeout(how):
    timeout_s = 3
    hang_s = timeout_s + 1.5  # rank 1 "hangs" past the group timeout, then finds its peer gone
    results = run_ranks(
        2, _peer_lost_worker, how, hang_s, timeout=60, env={group_mod.TIMEOUT_ENV: str(timeout_s)}
    )
    r0 = results[0]
    assert r0.exitcode == 0, r0.traceback
    assert isinstance(r0.value, dict), r0.value
    assert r0.value["message"].startswith("step 'calibrate' failed (seen from rank 0): could not agree")
    assert r0.value["elapsed"] < timeout_s + 3
    if how == "exit":
        assert results[1].exitcode == 3
    else:
        assert r0.value["elapsed"] > timeout_s - 1  # it waited for the timeout, no longer
        assert results[1].exitcode is not None  # rank 1 came back too (its peer is gone)
