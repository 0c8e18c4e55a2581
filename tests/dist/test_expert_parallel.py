"""Expert parallelism on gloo/CPU: logits, per-rank reads, export equality, failing together."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from _exports import read_export
from _mp import run_ranks
from safetensors import safe_open

from modelopt_k3.models.kimi_k3.converters import EXPERT_KEY_RE

pytestmark = pytest.mark.multiprocess

EP_ENV = {"MODELOPT_K3_DIST_TIMEOUT": "30", "OMP_NUM_THREADS": "1"}
ACTIVATION_SCALES = re.compile(r"\.(input_scale|k_scale|v_scale)$")


# --------------------------------------------------------------------------- rank workers (module level)


def _ep_logits(ckpt: str, ids: torch.Tensor, dense: str = "replicated"):
    from modelopt_k3 import load_pretrained
    from modelopt_k3.dist.group import run_group

    with run_group():
        model = load_pretrained(ckpt, plan="auto", trust_remote_code=True, dtype=torch.float32, dense=dense,
                                progress=False)
        info = model.modelopt_k3
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
        experts = {
            name: (m.expert_offset, m.num_experts)
            for name, m in model.named_modules()
            if info.spec.is_experts_module(name, m)
        }
        return logits, list(info.keys_read), info.bytes_read, experts, info.plan.kind, _buffers(model)


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer (all non-persistent in Kimi-K3): what the modules' __init__ built, kept through the load."""
    return {name: buf.clone() for name, buf in model.named_buffers()}


def _ep_ptq(argv: list[str], fail: str | None = None):
    """Run the hf_ptq CLI on this rank; ``fail`` makes rank 1 raise in 'calibration' or 'export'."""
    import os

    from modelopt_k3.cli import hf_ptq

    rank = int(os.environ["RANK"])
    if fail == "calibration" and rank == 1:
        import modelopt_k3.data as data

        original = data.make_forward_loop

        def failing_loop(batches, **kw):
            inner = original(batches, **kw)

            def loop(model):
                inner(model)
                raise RuntimeError("injected calibration failure on rank 1")

            return loop

        data.make_forward_loop = failing_loop
    if fail == "export" and rank == 1:
        from modelopt_k3.export import writer

        def failing_add(self, name, tensor):
            raise RuntimeError("injected export failure on rank 1")

        writer.ShardWriter.add = failing_add
    return hf_ptq.run(hf_ptq.build_parser().parse_args(argv))  # raises on failure


# --------------------------------------------------------------------------- helpers




def assert_exports_equal(a: Path, b: Path) -> None:
    ta, tb = read_export(a), read_export(b)
    assert set(ta) == set(tb), sorted(set(ta) ^ set(tb))[:10]
    for key in ta:
        x, y = ta[key], tb[key]
        assert x.dtype == y.dtype and x.shape == y.shape, key
        if ACTIVATION_SCALES.search(key):
            torch.testing.assert_close(x, y, rtol=0.01, atol=0, msg=key)
        else:
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), f"{key} differs"
    for name in ("config.json", "hf_quant_config.json"):
        assert json.loads((a / name).read_text()) == json.loads((b / name).read_text()), name


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def ep_ckpt(tmp_path_factory) -> Path:
    from modelopt_k3.testing import make_tiny_kimi_k3

    return make_tiny_kimi_k3(tmp_path_factory.mktemp("ep") / "tiny", num_experts=16)


@pytest.fixture(scope="module")
def single_logits(ep_ckpt):
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    (result,) = run_ranks(1, _ep_logits, str(ep_ckpt), ids, timeout=300, env=EP_ENV)
    assert result.exitcode == 0, result.traceback
    return ids, result.value


@pytest.mark.parametrize("world", [2, 4])
def test_ep_logits_equal_single_process_and_reads_are_local(ep_ckpt, single_logits, world):
    ids, (ref_logits, ref_keys, ref_bytes, _, kind, ref_buffers) = single_logits
    assert kind == "whole" and ref_buffers
    results = run_ranks(world, _ep_logits, str(ep_ckpt), ids, timeout=300, env=EP_ENV)
    assert [r.exitcode for r in results] == [0] * world, [r.traceback for r in results]
    expert_bytes = []
    for r in results:
        logits, keys, nbytes, experts, kind, buffers = r.value
        assert kind == "expert_parallel"
        assert buffers.keys() == ref_buffers.keys() and all(torch.equal(buffers[n], ref_buffers[n]) for n in buffers)
        rel = (logits - ref_logits).abs().max() / ref_logits.abs().max()
        assert rel <= 1e-5, f"rank {r.rank}: relative logits error {rel:.3g}"
        assert len(keys) == len(set(keys)), "a tensor was read twice"
        for key in keys:
            m = EXPERT_KEY_RE.match(key)
            if m is None:
                continue
            offset, count = experts[m["module"]]
            assert offset <= int(m["expert"]) < offset + count, f"rank {r.rank} read {key} of another rank"
        expert_bytes.append(sum(1 for k in keys if EXPERT_KEY_RE.match(k)))
    # Every expert tensor was read exactly once over all ranks.
    assert sum(expert_bytes) == sum(1 for k in ref_keys if EXPERT_KEY_RE.match(k))


PTQ_ARGS = ["--trust_remote_code", "--qformat", "nvfp4", "--kv_cache_qformat", "fp8", "--calib_size", "8",
            "--batch_size", "2", "--calib_seq", "32", "--no_progress"]


@pytest.fixture(scope="module")
def single_export(ep_ckpt, tmp_path_factory) -> Path:
    """The one-process export with bf16 experts, which every distributed export must equal."""
    single = tmp_path_factory.mktemp("single") / "export"
    (r,) = run_ranks(1, _ep_ptq, [*PTQ_ARGS, "--pyt_ckpt_path", str(ep_ckpt), "--export_path", str(single),
                                  "--experts", "bf16"], timeout=300, env=EP_ENV)
    assert r.exitcode == 0, r.traceback
    return single


def test_ep_export_equals_single_process_export(ep_ckpt, single_export, tmp_path):
    """EP exports equal the one-process bf16 export: packed experts (hf_ptq --experts packed) at EP 2 and 4,
    bf16 experts on 4 ranks as two replicas of an EP-2 group (byte for byte, activation scales within 1%)."""
    for world, ep, experts in ((2, 2, "packed"), (4, 4, "packed"), (4, 2, "bf16")):
        out = tmp_path / f"ep{world}-{ep}-{experts}"
        args = [*PTQ_ARGS, "--pyt_ckpt_path", str(ep_ckpt), "--export_path", str(out), "--ep_degree", str(ep),
                "--experts", experts]
        results = run_ranks(world, _ep_ptq, args, timeout=300, env=EP_ENV)
        assert [x.exitcode for x in results] == [0] * world, [x.traceback for x in results]
        assert_exports_equal(single_export, out)
        assert not list(tmp_path.glob(".*tmp*")), "temporary export directory left behind"


def _owner_implementation_logits(ckpt: str, ids: torch.Tensor, impl: str | None, experts: str, chunk: int | None):
    """EP logits with the owner running ``impl``; counts the calls each implementation got on this rank."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from modelopt_k3 import load_pretrained
    from modelopt_k3.dist.group import run_group

    calls: dict[str, int] = {}
    for name in ("grouped_mm", "batched_mm"):
        real = ALL_EXPERTS_FUNCTIONS[name]

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*a, **k)

        ALL_EXPERTS_FUNCTIONS[name] = counted
    with run_group():
        model = load_pretrained(ckpt, plan="auto", trust_remote_code=True, dtype=torch.float32, progress=False,
                                experts_implementation=impl, experts=experts, decode_chunk=chunk)
        plan = model.modelopt_k3.plan
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
        return logits, calls, plan.experts_implementation, plan.local_experts_implementation


def test_owner_runs_the_plans_local_implementation(ep_ckpt, single_logits):
    """Under torch_a2a the owner's experts run the plan's local implementation (here grouped_mm, with packed
    experts decoded 3 at a time): it is the one called, and the logits are the one-process eager ones."""
    ids, (ref_logits, *_) = single_logits
    results = run_ranks(2, _owner_implementation_logits, str(ep_ckpt), ids, "grouped_mm", "packed", 3,
                        timeout=300, env=EP_ENV)
    assert [r.exitcode for r in results] == [0, 0], [r.traceback for r in results]
    for r in results:
        logits, calls, dispatch, local = r.value
        assert (dispatch, local) == ("torch_a2a", "grouped_mm")
        assert calls.get("grouped_mm", 0) > 0 and "batched_mm" not in calls, calls
        rel = (logits - ref_logits).abs().max() / ref_logits.abs().max()
        assert rel <= 1e-5, f"rank {r.rank}: relative logits error {rel:.3g}"


def test_plan_decides_the_local_implementation(monkeypatch):
    from modelopt_k3.dist.plan import PlanError, decide_plan
    from modelopt_k3.spec import get_spec

    kw = dict(spec=get_spec("kimi_k3"), num_experts=8, rank=0, world_size=2)
    cpu = decide_plan("expert_parallel", device=torch.device("cpu"), **kw)
    assert (cpu.experts_implementation, cpu.local_experts_implementation) == ("torch_a2a", "eager")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu = decide_plan("expert_parallel", device=torch.device("cuda", 0), dtype=torch.bfloat16, **kw)
    assert gpu.local_experts_implementation == "grouped_mm"
    # torch's grouped_mm kernel takes bf16 only: an fp32 load runs eager on the owner.
    fp32 = decide_plan("expert_parallel", device=torch.device("cuda", 0), dtype=torch.float32, **kw)
    assert fp32.local_experts_implementation == "eager"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert decide_plan("expert_parallel", device=torch.device("cuda", 0), **kw).local_experts_implementation == "eager"
    named = decide_plan("expert_parallel", device=torch.device("cpu"), experts_implementation="batched_mm", **kw)
    assert (named.experts_implementation, named.local_experts_implementation) == ("torch_a2a", "batched_mm")
    with pytest.raises(PlanError, match="unknown experts implementation"):
        decide_plan("expert_parallel", device=torch.device("cpu"), experts_implementation="fast", **kw)


@pytest.mark.parametrize("stage", ["calibration", "export"])
def test_rank_failure_fails_all_ranks_and_leaves_no_checkpoint(ep_ckpt, tmp_path, stage):
    out = tmp_path / "out"
    env = {**EP_ENV, "MODELOPT_K3_DIST_TIMEOUT": "20"}
    results = run_ranks(2, _ep_ptq, [*PTQ_ARGS, "--pyt_ckpt_path", str(ep_ckpt), "--export_path", str(out)],
                        stage, timeout=120, env=env)
    assert all(r.exitcode not in (0, None) for r in results), [(r.rank, r.exitcode) for r in results]
    assert any("rank 1" in (r.error or "") for r in results), [r.error for r in results]
    assert not out.exists()
    assert not list(tmp_path.glob(".*tmp*"))


def test_missing_expert_on_one_rank_fails_every_rank_at_load(ep_ckpt, tmp_path):
    """Rank 1's expert lacks a tensor: every rank refuses in the source check (headers only, before any
    read: each rank sees every expert's header), naming the key; none waits for a timeout."""
    from conftest import copy_checkpoint

    key = "language_model.model.layers.2.block_sparse_moe.experts.12.w3.weight_packed"  # expert 12: rank 1 of 2
    broken = copy_checkpoint(ep_ckpt, tmp_path / "broken", drop=[key])
    ids = torch.zeros(1, 8, dtype=torch.long)
    results = run_ranks(2, _ep_logits, str(broken), ids, timeout=120, env=EP_ENV)
    assert all(r.exitcode not in (0, None) for r in results), [(r.rank, r.exitcode) for r in results]
    for r in results:
        assert "load: check the checkpoint" in r.error and "failed on ranks 0, 1" in r.error, r.error
        assert "experts.12.w3.weight_packed" in r.error, r.error
        assert r.wall_s < 60, f"rank {r.rank} took {r.wall_s:.0f}s: it waited for a timeout"


def test_ep_with_fsdp2_dense_part(ep_ckpt, single_logits, single_export, tmp_path):
    """Experts expert-parallel, dense part FSDP2-sharded: same logits and export as one process."""
    ids, (ref_logits, ref_keys, _, _, _, ref_buffers) = single_logits
    results = run_ranks(2, _ep_logits, str(ep_ckpt), ids, "fsdp2", timeout=300, env=EP_ENV)
    assert [r.exitcode for r in results] == [0, 0], [r.traceback for r in results]
    dense_keys = {k for k in ref_keys if not EXPERT_KEY_RE.match(k)}
    for r in results:
        logits, keys, _, experts, kind, buffers = r.value
        rel = (logits - ref_logits).abs().max() / ref_logits.abs().max()
        assert kind == "expert_parallel" and rel <= 1e-5, f"rank {r.rank}: {rel:.3g}"
        assert all(torch.equal(buffers[n], ref_buffers[n]) for n in ref_buffers)
        for key in keys:
            m = EXPERT_KEY_RE.match(key)
            if m is not None:
                offset, count = experts[m["module"]]
                assert offset <= int(m["expert"]) < offset + count, f"rank {r.rank} read {key} of another rank"
        assert dense_keys <= set(keys)  # every dense tensor is read, but only this rank's rows of it

    # The export, with packed experts: the one-process bf16 checkpoint.
    hybrid = tmp_path / "hybrid"
    args = [*PTQ_ARGS, "--pyt_ckpt_path", str(ep_ckpt), "--export_path", str(hybrid), "--dense", "fsdp2",
            "--experts", "packed"]
    results = run_ranks(2, _ep_ptq, args, timeout=300, env=EP_ENV)
    assert [x.exitcode for x in results] == [0, 0], [x.traceback for x in results]
    assert_exports_equal(single_export, hybrid)


def test_dense_sharding_refusals():
    from modelopt_k3.dist.plan import PlanError, decide_plan
    from modelopt_k3.spec import get_spec

    spec, cpu = get_spec("kimi_k3"), torch.device("cpu")
    kw = dict(spec=spec, num_experts=8, rank=0, device=cpu)
    plan = decide_plan("expert_parallel", world_size=2, dense="fsdp2", **kw)
    assert plan.dense == "fsdp2" and plan.fsdp_sharded and "dense=fsdp2" in plan.describe()
    with pytest.raises(PlanError, match="unknown dense sharding"):
        decide_plan("expert_parallel", world_size=2, dense="zero3", **kw)
    with pytest.raises(PlanError, match="replicated expert groups"):
        decide_plan("expert_parallel", world_size=4, ep_degree=2, dense="fsdp2", **kw)
    with pytest.raises(PlanError, match="applies to plan 'expert_parallel'"):
        decide_plan("whole", world_size=1, dense="fsdp2", **kw)
