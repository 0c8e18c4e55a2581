"""The fsdp2 plan on gloo/CPU: logits, per-rank shard reads, export equality, refusals."""

from __future__ import annotations

import pytest
import torch
from _mp import run_ranks
from dist.test_expert_parallel import EP_ENV, PTQ_ARGS, _buffers, _ep_ptq, assert_exports_equal

from modelopt_k3.models.kimi_k3.converters import EXPERT_KEY_RE

pytestmark = pytest.mark.multiprocess


# --------------------------------------------------------------------------- rank workers (module level)


def _fsdp_logits(ckpt: str, ids: torch.Tensor, plan: str):
    from torch.distributed.tensor import DTensor

    from modelopt_k3 import load_pretrained
    from modelopt_k3.checkpoint import CheckpointReader
    from modelopt_k3.dist.fsdp import local_experts
    from modelopt_k3.dist.group import run_group

    with run_group():
        model = load_pretrained(ckpt, plan=plan, trust_remote_code=True, dtype=torch.float32, progress=False)
        info = model.modelopt_k3
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
        # After the forward every parameter is a shard again (nothing left gathered, the root included).
        resharded = all(isinstance(p, DTensor) for p in model.parameters()) if plan == "fsdp2" else None
        experts = {
            name: local_experts(m, info.spec) for name, m in model.named_modules() if info.spec.is_experts_module(name, m)
        }
        with CheckpointReader(ckpt) as reader:
            sizes = {k: reader.info(k).nbytes for k in reader.names()}
        return logits, list(info.keys_read), info.bytes_read, experts, info.plan.kind, resharded, sizes, _buffers(model)


def _quantized_logits(ckpt: str, ids: torch.Tensor, plan: str):
    """Every rank calibrates on the same batch, so amax (and the fake-quant forward) must match one process."""
    from modelopt_k3 import load_pretrained, quantize
    from modelopt_k3.dist.group import run_group

    with run_group():
        model = load_pretrained(ckpt, plan=plan, trust_remote_code=True, dtype=torch.float32, progress=False)
        quantize(model, "presets/nvfp4", lambda m: m(input_ids=ids, use_cache=False), verbose=False)
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits


def _ptq(argv: list[str]):
    from modelopt_k3.cli import hf_ptq

    return hf_ptq.run(hf_ptq.build_parser().parse_args(argv))  # raises on failure


def _refusals(cases: list[tuple[str, dict]]):
    """Each case's load error ("Type: message"), or None when it loaded."""
    from modelopt_k3 import load_pretrained
    from modelopt_k3.dist.group import run_group

    out = []
    with run_group():
        for ckpt, kwargs in cases:
            try:
                load_pretrained(ckpt, trust_remote_code=True, progress=False, **kwargs)
                out.append(None)
            except Exception as exc:
                out.append(f"{type(exc).__name__}: {exc}")
    return out


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def fsdp_ckpt(tmp_path_factory):
    from modelopt_k3.testing import make_tiny_kimi_k3

    return make_tiny_kimi_k3(tmp_path_factory.mktemp("fsdp") / "tiny", num_experts=16)


@pytest.fixture(scope="module")
def single(fsdp_ckpt):
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    (result,) = run_ranks(1, _fsdp_logits, str(fsdp_ckpt), ids, "whole", timeout=300, env=EP_ENV)
    assert result.exitcode == 0, result.traceback
    return ids, result.value


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_logits_equal_single_process_and_each_rank_reads_its_shard(fsdp_ckpt, single, world):
    ids, (ref_logits, ref_keys, ref_bytes, *_, sizes, ref_buffers) = single
    results = run_ranks(world, _fsdp_logits, str(fsdp_ckpt), ids, "fsdp2", timeout=300, env=EP_ENV)
    assert [r.exitcode for r in results] == [0] * world, [r.traceback for r in results]
    assert ref_bytes == sum(sizes.values())
    total_bytes = expert_bytes = 0
    for r in results:
        logits, keys, nbytes, experts, kind, resharded, _, buffers = r.value
        assert kind == "fsdp2" and resharded
        # Buffers are not sharded: each rank keeps what __init__ built (to_empty did not wipe them).
        assert ref_buffers and all(torch.equal(buffers[n], ref_buffers[n]) for n in ref_buffers)
        rel = (logits - ref_logits).abs().max() / ref_logits.abs().max()
        assert rel <= 1e-5, f"rank {r.rank}: relative logits error {rel:.3g}"
        assert len(keys) == len(set(keys)), "a tensor was read twice"
        mine = 0
        for key in keys:
            m = EXPERT_KEY_RE.match(key)
            if m is not None:
                assert int(m["expert"]) in experts[m["module"]], f"rank {r.rank} read {key} of another rank"
                mine += sizes[key]
        assert all(len(rng) == 16 // world for rng in experts.values())
        # Every tensor is sharded: each rank reads ~1/world of the bytes (dense rows round up per tensor).
        assert nbytes <= sum(sizes.values()) / world * 1.1, (r.rank, nbytes)
        total_bytes += nbytes
        expert_bytes += mine
    # Over all ranks every byte was read exactly once: dense rows tile each tensor, experts are disjoint.
    # Tensors that go through a dense conversion (A_log, zero-padded) are read whole by every rank.
    converted = sum(v for k, v in sizes.items() if k.endswith(".A_log"))
    assert total_bytes == ref_bytes + (world - 1) * converted
    assert expert_bytes == sum(v for k, v in sizes.items() if EXPERT_KEY_RE.match(k))


def test_fsdp2_fake_quant_logits_equal_single_process(fsdp_ckpt, single):
    """Weight amax over the full sharded tensors, the lossless MXFP4 experts gathered from each rank's rows."""
    ids = single[0]
    (ref,) = run_ranks(1, _quantized_logits, str(fsdp_ckpt), ids, "whole", timeout=300, env=EP_ENV)
    assert ref.exitcode == 0, ref.traceback
    results = run_ranks(2, _quantized_logits, str(fsdp_ckpt), ids, "fsdp2", timeout=300, env=EP_ENV)
    assert [r.exitcode for r in results] == [0, 0], [r.traceback for r in results]
    for r in results:
        rel = (r.value - ref.value).abs().max() / ref.value.abs().max()
        assert rel <= 1e-5, f"rank {r.rank}: relative error {rel:.3g} of the fake-quantized logits"


def test_fsdp2_export_equals_single_process_export(fsdp_ckpt, tmp_path):
    ref = tmp_path / "single"
    (r,) = run_ranks(1, _ptq, [*PTQ_ARGS, "--pyt_ckpt_path", str(fsdp_ckpt), "--export_path", str(ref)],
                     timeout=300, env=EP_ENV)
    assert r.exitcode == 0, r.traceback
    for world in (2, 4):
        out = tmp_path / f"fsdp{world}"
        args = [*PTQ_ARGS, "--pyt_ckpt_path", str(fsdp_ckpt), "--export_path", str(out), "--plan", "fsdp2"]
        results = run_ranks(world, _ptq, args, timeout=300, env=EP_ENV)
        assert [x.exitcode for x in results] == [0] * world, [x.traceback for x in results]
        assert_exports_equal(ref, out)
        assert not list(tmp_path.glob(".*tmp*")), "temporary export directory left behind"


def test_fsdp2_rank_failure_in_export_fails_all_ranks(fsdp_ckpt, tmp_path):
    """A rank that fails while others gather dense weights to their owners keeps joining, then all fail."""
    out = tmp_path / "out"
    args = [*PTQ_ARGS, "--pyt_ckpt_path", str(fsdp_ckpt), "--export_path", str(out), "--plan", "fsdp2"]
    results = run_ranks(2, _ep_ptq, args, "export", timeout=120, env={**EP_ENV, "MODELOPT_K3_DIST_TIMEOUT": "20"})
    assert all(r.exitcode not in (0, None) for r in results), [(r.rank, r.exitcode) for r in results]
    assert all("injected export failure on rank 1" in (r.error or "") for r in results), [r.error for r in results]
    assert not out.exists() and not list(tmp_path.glob(".*tmp*"))


def test_fsdp2_refusals(fsdp_ckpt, tmp_path):
    """Impossible fsdp2 configurations are refused on every rank before anything is built (one process: test_load)."""
    from modelopt_k3.testing import make_tiny_kimi_k3

    odd = make_tiny_kimi_k3(tmp_path / "odd", num_experts=3)
    cases = [
        (str(odd), {"plan": "fsdp2"}, "num_experts=3 is not divisible by WORLD_SIZE=2"),
        (str(fsdp_ckpt), {"plan": "fsdp2", "ep_degree": 2}, "applies to plan 'expert_parallel'"),
        (str(fsdp_ckpt), {"plan": "fsdp2", "experts_implementation": "torch_a2a"}, "torch_a2a"),
    ]
    results = run_ranks(2, _refusals, [c[:2] for c in cases], timeout=120, env=EP_ENV)
    assert [x.exitcode for x in results] == [0, 0], [x.traceback for x in results]
    for r in results:
        for (_, _, message), got in zip(cases, r.value):
            assert got is not None and got.startswith("PlanError") and message in got, (message, got)
