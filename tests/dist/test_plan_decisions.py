"""Each plan decision is made once and passed on (issue 22): plan kinds and residencies as str enums, the
fsdp2-vs-packed rule in one place, ``--experts auto`` resolved once, and the memory planner planning
the placement the run will use (``MODELOPT_K3_EP_DEGREE`` read by the command line only)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from modelopt_k3.dist.kinds import EP_DEGREE_ENV
from modelopt_k3.dist.plan import (
    EXPERTS_CHOICES,
    PLAN_KINDS,
    PlanKind,
    Residency,
    ResidencyError,
    decide_plan,
    residency_refusal,
)
from modelopt_k3.memory.inventory import read_layout
from modelopt_k3.memory.planner import Asked, check_fits, estimate_asked
from modelopt_k3.models.kimi_k3 import KIMI_K3_SPEC

CPU = torch.device("cpu")


def _plan(kind: str, world_size: int, **kw):
    return decide_plan(kind, spec=KIMI_K3_SPEC, num_experts=8, rank=0, world_size=world_size, device=CPU, **kw)


def test_kinds_are_str_enums_that_read_and_write_as_the_cli_strings():
    plan = _plan("auto", 2, experts_implementation="eager")
    assert plan.kind is PlanKind.EXPERT_PARALLEL and plan.kind == "expert_parallel"
    assert f"{plan.kind}" == str(plan.kind) == "expert_parallel" and json.dumps([plan.kind]) == '["expert_parallel"]'
    assert {("expert_parallel", "bf16"): 1}[(plan.kind, plan.experts_residency)] == 1  # hashes as the string
    assert PLAN_KINDS == ("auto", "whole", "fsdp2", "expert_parallel") and EXPERTS_CHOICES == ("auto", "bf16", "packed")
    from modelopt_k3.cli.hf_ptq import build_parser

    choices = {a.dest: list(a.choices) for a in build_parser()._actions if a.choices}
    assert choices["plan"] == list(PLAN_KINDS) and choices["experts"] == list(EXPERTS_CHOICES)


def test_fsdp2_cannot_hold_packed_experts_one_rule_everywhere(tiny_ckpt: Path):
    why = residency_refusal("fsdp2", "packed", packed_source=True)
    assert why is not None and why.startswith("plan 'fsdp2' gathers whole layers of experts")
    # The run refuses it with that message ...
    with pytest.raises(ResidencyError) as err:
        _plan("fsdp2", 2).with_residency("packed")
    assert str(err.value) == why
    # ... the planner reports the same refusal ...
    refused = estimate_asked(read_layout(tiny_ckpt), Asked("fsdp2", "replicated", "packed", 2))
    assert refused.refused == why and refused.plan is None
    fits = check_fits(tiny_ckpt, plan="fsdp2", world_size=2, experts="packed", device="cpu")  # fit_plan's path
    assert fits.refused == why and fits.plan is None and fits.asked.residency == "packed"
    # ... and auto never considers it: bf16.
    assert check_fits(tiny_ckpt, plan="fsdp2", world_size=2, experts="auto", device="cpu").plan.experts_residency \
        == Residency.BF16


def test_the_planner_plans_the_placement_the_run_uses(tiny_ckpt: Path, tmp_path: Path, monkeypatch):
    kw = dict(plan="expert_parallel", world_size=4, experts="bf16", batch_size=2, calib_seq=32, device="cpu",
              gpu_mem_gib=64)
    default = check_fits(tiny_ckpt, **kw)
    two = check_fits(tiny_ckpt, ep_degree=2, **kw)
    run = decide_plan("expert_parallel", spec=KIMI_K3_SPEC, num_experts=8, rank=0, world_size=4, device=CPU,
                      ep_degree=2)  # what load_pretrained(ep_degree=2) decides
    assert two.plan.ep_degree == run.ep_degree == 2 and two.plan.expert_placement == run.expert_placement
    # 8 experts over EP 2 is 4 a rank, over EP 4 (the world) 2: the estimate follows the placement.
    assert two.resident_experts == 2 * default.resident_experts > 0
    assert "EP 2" in two.label()
    # $MODELOPT_K3_EP_DEGREE is hf_ptq's --ep_degree default, read by the command line; no stage reads it.
    monkeypatch.setenv(EP_DEGREE_ENV, "2")
    assert _plan("expert_parallel", 4).ep_degree == 4
    assert check_fits(tiny_ckpt, **kw).plan.ep_degree == 4
    for flags, want in (((), 2), (("--ep_degree", "4"), 4)):  # the flag wins over the environment
        ctx = _preflight(tiny_ckpt, tmp_path / f"out{want}", *flags, world_size=4)
        ctx.close()
        assert ctx.distribution.ep_degree == want


def _preflight(ckpt: Path, out: Path, *flags: str, world_size: int = 1):
    from modelopt_k3.cli.hf_ptq import _preflight, build_parser
    from modelopt_k3.export.layouts import MODELOPT
    from modelopt_k3.run.plan import PtqConfig

    argv = ["--pyt_ckpt_path", str(ckpt), "--trust_remote_code", "--export_path", str(out), "--calib_size", "2",
            "--batch_size", "2", "--calib_seq", "16", *flags]
    group = SimpleNamespace(rank=0, world_size=world_size, device=CPU)
    return _preflight(PtqConfig.from_namespace(build_parser().parse_args(argv)), MODELOPT, group, ckpt, True)


def test_hf_ptq_loads_with_the_preflight_resolution(tiny_ckpt: Path, tmp_path: Path, monkeypatch):
    """``--experts auto`` is resolved once (the preflight, at the CLI's batch and sequence length) into the
    run's ``DistributionPlan``: its residency an enum, its decode chunk set; the load takes that plan as it is.
    A plan the run cannot make is refused by the preflight (before anything is loaded)."""
    import modelopt_k3.load
    from modelopt_k3.cli.hf_ptq import _load
    from modelopt_k3.dist.plan import PlanError
    from modelopt_k3.memory.planner import plan_memory

    report = plan_memory(tiny_ckpt, world_size=1, batch_size=2, calib_seq=16, device="cpu",
                         plans=[("whole", "replicated")])
    bf16, packed = report.find("whole", "replicated", "bf16").peak, report.find("whole", "replicated", "packed").peak
    assert packed < bf16
    budget = (packed + bf16) / 2 / 2**30  # bf16 does not fit, packed does
    seen = []
    monkeypatch.setattr(modelopt_k3.load, "load_planned", lambda run, **kw: seen.append(run.distribution))
    for flags, want in (((), Residency.BF16), (("--gpu_mem_gib", str(budget)), Residency.PACKED)):
        ctx = _preflight(tiny_ckpt, tmp_path / "out", "--experts", "auto", *flags)
        try:
            plan = ctx.run_plan()
        finally:
            ctx.close()
        assert type(plan.distribution.experts_residency) is Residency and plan.distribution.experts_residency is want
        assert plan.distribution.decode_chunk == plan.memory.decode_chunk
        assert plan.memory.plan.experts_residency is want
        _load(plan, False)
        assert seen[-1] is plan.distribution
    with pytest.raises(PlanError, match="plan 'whole' runs in one process"):
        _preflight(tiny_ckpt, tmp_path / "out", "--plan", "whole", world_size=2)
