"""Weight algorithms under expert parallelism: on 2 gloo ranks each owner searches its own experts' block
scales, or (local_hessian, gptq) accumulates each own expert's Hessian from the tokens torch_a2a brings it (nothing per
expert travels), and dense Hessians are summed over ranks; the export equals the one-process export of the
same algorithm byte for byte."""

from __future__ import annotations

import pytest
import torch
from _exports import read_export
from _mp import run_ranks

from .conftest import quantize_and_export
from .test_qwen3_moe_ep import EP_ENV

pytestmark = pytest.mark.multiprocess

RECIPES = ("presets/nvfp4_default_mse", "presets/nvfp4_default_four_over_six", "presets/nvfp4_default_local_hessian",
           "presets/nvfp4_default_gptq")


def _ep_runs(ckpt: str, outs: list[str], recipes: tuple[str, ...] = RECIPES, ep_degree: int | None = None):
    """Each rank calibrates on its own share of the tokens (expert parallel), one export per recipe; with
    ``ep_degree`` below the world size every expert block has replicas, and no routed expert keeps max or mse."""
    import modelopt_k3
    from modelopt_k3.dist.group import run_group
    from modelopt_k3.testing.qwen3_moe import calibration_token_ids

    with run_group() as group:
        share = calibration_token_ids().chunk(group.world_size)[group.rank]

        def loop(m):
            with torch.no_grad():
                m(input_ids=share)

        for recipe, out in zip(recipes, outs):
            model = modelopt_k3.load_pretrained(ckpt, ep_degree=ep_degree, progress=False)
            assert model.modelopt_k3.plan.kind == "expert_parallel"
            modelopt_k3.quantize(model, recipe, loop, verbose=False)
            if ep_degree is not None:
                assert model.modelopt_k3.placement.experts.replicas is not None
                labels = model.modelopt_k3_quant.calibration
                assert all(not v.startswith(("max", "mse")) for k, v in labels.items() if ".experts." in k), labels
            modelopt_k3.export_checkpoint(model, out, progress=False)


def test_ep2_weight_algorithms_equal_one_process(qwen3_moe_ckpt, tmp_path):
    outs = [str(tmp_path / f"ep2_{i}") for i in range(len(RECIPES))]
    results = run_ranks(2, _ep_runs, str(qwen3_moe_ckpt), outs, timeout=600, env=EP_ENV)
    assert [r.exitcode for r in results] == [0, 0], [r.traceback for r in results]
    for recipe, out in zip(RECIPES, outs):
        single = quantize_and_export(qwen3_moe_ckpt, tmp_path / f"one_{recipe.rsplit('/', 1)[1]}", recipe)
        ours, theirs = read_export(tmp_path / out), read_export(single)
        assert set(ours) == set(theirs), recipe
        for key, t in theirs.items():
            assert torch.equal(ours[key].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), (recipe, key)
        if recipe.endswith("gptq"):  # routed experts too were updated (by their owners), not left at max
            maxed = read_export(quantize_and_export(qwen3_moe_ckpt, tmp_path / "one_max", "presets/nvfp4_default"))
            moved = [k for k in theirs if ".experts." in k and k.endswith(".weight")
                     and not torch.equal(theirs[k].view(torch.uint8), maxed[k].view(torch.uint8))]
            assert len(moved) > 24, moved
        if recipe.endswith("local_hessian"):  # routed experts weighted by their owners' Hessians, not mse's plain search
            plain = read_export(tmp_path / "one_nvfp4_default_mse")
            weighted = [k for k in theirs if ".experts." in k and k.endswith(".weight_scale")
                        and not torch.equal(theirs[k].view(torch.uint8), plain[k].view(torch.uint8))]
            assert len(weighted) > 24, weighted


HESSIAN_RECIPES = ("presets/nvfp4_default_local_hessian", "presets/nvfp4_default_gptq")


def test_replicated_expert_groups_add_up_their_replicas_hessians(qwen3_moe_ckpt, tmp_path):
    """EP 2 on 4 ranks (two replicas of each expert block, each with its own tokens): each expert's Hessian sums
    are added up over the ranks holding it, so local_hessian and gptq export what one process exports from all
    the tokens, byte for byte."""
    ranks = 4
    outs = [str(tmp_path / f"rep_{i}") for i in range(len(HESSIAN_RECIPES))]
    results = run_ranks(ranks, _ep_runs, str(qwen3_moe_ckpt), outs, HESSIAN_RECIPES, 2, timeout=600, env=EP_ENV)
    assert [r.exitcode for r in results] == [0] * ranks, [r.traceback for r in results]
    for recipe, out in zip(HESSIAN_RECIPES, outs):
        single = quantize_and_export(qwen3_moe_ckpt, tmp_path / f"one_{recipe.rsplit('/', 1)[1]}", recipe)
        ours, theirs = read_export(out), read_export(single)
        assert set(ours) == set(theirs), recipe
        for key, t in theirs.items():
            assert torch.equal(ours[key].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), (recipe, key)


def test_ep2_act_headroom_equals_one_process(qwen3_moe_ckpt, tmp_path):
    """nvfp4_act_headroom on 2 gloo ranks, each counting its own tokens' blocks (dense inputs at every rank, routed
    experts' down inputs at their owners): the summed histograms are one process's, so the export is byte for byte
    the one-process export; and the rule moved input scales off max's."""
    recipe = "presets/nvfp4_default_act_headroom"
    results = run_ranks(2, _ep_runs, str(qwen3_moe_ckpt), [str(tmp_path / "ep2")], (recipe,), timeout=600, env=EP_ENV)
    assert [r.exitcode for r in results] == [0, 0], [r.traceback for r in results]
    ours = read_export(tmp_path / "ep2")
    theirs = read_export(quantize_and_export(qwen3_moe_ckpt, tmp_path / "one", recipe))
    assert set(ours) == set(theirs)
    for key, t in theirs.items():
        assert torch.equal(ours[key].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), key
    maxed = read_export(quantize_and_export(qwen3_moe_ckpt, tmp_path / "one_max", "presets/nvfp4_default"))
    inputs = [k for k in theirs if k.endswith(".input_scale")]
    moved = [k for k in inputs if not torch.equal(theirs[k], maxed[k])]
    assert inputs and len(moved) == len(inputs), sorted(set(inputs) - set(moved))[:5]
    assert all(torch.equal(theirs[k], maxed[k]) for k in theirs if k.endswith((".weight_scale_2", ".weight")))
