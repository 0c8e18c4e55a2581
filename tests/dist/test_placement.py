"""The placement: refused with the numbers and the fix, kept on module instances (two placements in one
process), and settings a plan cannot act on warned about."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from modelopt_k3.dist.placement import ExpertPlacement, PlanError
from modelopt_k3.dist.plan import IneffectiveSettingWarning, decide_plan
from modelopt_k3.load import load_pretrained, resolve_model_class
from modelopt_k3.models.kimi_k3 import KIMI_K3_SPEC
from modelopt_k3.spec import PrepareContext, SpecError

pytestmark = pytest.mark.usefixtures("restore_remote_code")
CPU = torch.device("cpu")


def _experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return KIMI_K3_SPEC.experts_modules(model)


def test_plan_and_spec_errors_are_value_errors_with_numbers_and_fix() -> None:
    assert issubclass(PlanError, ValueError) and issubclass(SpecError, ValueError)
    with pytest.raises(PlanError, match=r"num_experts=8 .* degree 3; choose a degree that divides it \(one of \[1, 2, 4, 8\]\)"):
        ExpertPlacement(8, ep_size=3)
    with pytest.raises(PlanError, match=r"degree 3 must divide the world size 4; choose one of \[1, 2, 4\]"):
        decide_plan("expert_parallel", spec=KIMI_K3_SPEC, num_experts=8, rank=0, world_size=4, device=CPU,
                    ep_degree=3)


@pytest.mark.parametrize(("num_experts", "ep_size"), [(8, 1), (8, 2), (8, 4), (12, 3)])
def test_expert_blocks_partition_the_experts_and_owner_inverts_them(num_experts: int, ep_size: int) -> None:
    """Rank r holds one contiguous block, the blocks cover every expert once in rank order, and ``owner``
    (what the token exchange routes by, on ints and id tensors) names the rank whose block holds an expert."""
    placements = [ExpertPlacement(num_experts, ep_size=ep_size, ep_rank=r) for r in range(ep_size)]
    blocks = [p.local for p in placements]
    assert [e for block in blocks for e in block] == list(range(num_experts))
    assert all(len(block) == num_experts // ep_size for block in blocks)
    for rank, p in enumerate(placements):
        assert [p.owner(e) for e in range(num_experts)] == [r for r, b in enumerate(blocks) for _ in b]
        ids = torch.arange(num_experts)
        assert torch.equal(p.owner(ids), torch.tensor([r for r, b in enumerate(blocks) for _ in b]))
        assert p.global_ids(range(1, 2)) == range(blocks[rank].start + 1, blocks[rank].start + 2)
    with pytest.raises(PlanError, match="outside the group"):
        ExpertPlacement(num_experts, ep_size=ep_size, ep_rank=ep_size)
    assert ExpertPlacement(num_experts, ep_size=ep_size, ep_rank=0).ep_rank == 0  # rank 0 is inside


def test_plan_builds_the_expert_placement_once() -> None:
    kw = dict(spec=KIMI_K3_SPEC, num_experts=8, world_size=4, device=CPU, ep_degree=2)
    # World 4, EP degree 2: two replicas of a 2-rank EP group; replica 0 (ranks 0, 1) writes the experts.
    got = [decide_plan("expert_parallel", rank=r, **kw).expert_placement for r in range(4)]
    assert [(p.ep_rank, p.local, p.writes_experts) for p in got] == [
        (0, range(0, 4), True), (1, range(4, 8), True), (0, range(0, 4), False), (1, range(4, 8), False)
    ]
    whole = decide_plan("whole", spec=KIMI_K3_SPEC, num_experts=8, rank=0, world_size=1, device=CPU)
    assert whole.expert_placement == ExpertPlacement(8)
    single = whole.build_placement()  # one process: no mesh, no group
    assert single.mesh is None and single.experts.group is None
    with pytest.raises(PlanError, match="one process"):
        single.fsdp_mesh  # noqa: B018


def test_settings_without_effect_warn() -> None:
    kw = dict(spec=KIMI_K3_SPEC, num_experts=8, rank=0, world_size=1, device=CPU)
    with pytest.warns(IneffectiveSettingWarning, match=r"'torch_a2a' has no effect under plan 'whole'"):
        plan = decide_plan("whole", experts_implementation="torch_a2a", **kw)
    assert (plan.experts_implementation, plan.local_experts_implementation) == ("torch_a2a", "eager")
    with pytest.warns(IneffectiveSettingWarning, match=r"ep_degree=2 has no effect under plan 'whole'"):
        decide_plan("auto", ep_degree=2, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", IneffectiveSettingWarning)
        decide_plan("whole", experts_implementation="batched_mm", **kw)  # it runs the experts: no warning
        decide_plan("expert_parallel", experts_implementation="batched_mm", **{**kw, "world_size": 2})


def test_two_placements_in_one_process(tiny_ckpt: Path) -> None:
    """The patched class holds no placement: an EP-placed model and a whole one coexist, and a whole load
    after an expert-parallel build works (it used to be refused as a stale process-wide patch)."""
    raw = json.loads((tiny_ckpt / "config.json").read_text())
    KIMI_K3_SPEC.loading.build(tiny_ckpt)
    model_cls, config = resolve_model_class(tiny_ckpt, raw, trust_remote_code=True)
    KIMI_K3_SPEC.loading.prepare(PrepareContext(model_cls, config, tiny_ckpt))
    num = config.text_config.num_experts
    with torch.device("meta"):
        ep_model, other = model_cls(config), model_cls(config)
    rank1 = ExpertPlacement(num, ep_size=2, ep_rank=1, writes_experts=False)
    KIMI_K3_SPEC.experts.place_experts(ep_model, rank1)

    loaded = load_pretrained(tiny_ckpt, plan="whole", trust_remote_code=True, progress=False)

    for name, module in _experts(ep_model).items():
        assert module.placement is rank1, name
        assert (module.num_experts, module.expert_offset, module.num_global_experts) == (num // 2, num // 2, num)
        assert module.gate_up_proj.shape[0] == num // 2 and module.down_proj.shape[0] == num // 2
    for model in (other, loaded):
        for name, module in _experts(model).items():
            assert module.placement.local == range(num) and module.placement.ep_size == 1, name
            assert module.gate_up_proj.shape[0] == num
    assert loaded.modelopt_k3.placement.experts is next(iter(_experts(loaded).values())).placement
    with pytest.raises(ValueError, match="needs a module holding all"):
        KIMI_K3_SPEC.experts.place_experts(ep_model, ExpertPlacement(num, ep_size=2))  # already placed
