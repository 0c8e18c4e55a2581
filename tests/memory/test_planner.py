"""The memory planner (memory/): headers only, its figures against loaded models, the full-size Kimi-K3
layout without the bytes, and hf_ptq's refusal before loading."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from memory._live import LiveTensors
from modelopt_k3.checkpoint import CheckpointReader, read_header
from modelopt_k3.memory.inventory import read_layout
from modelopt_k3.memory.planner import (
    Asked,
    GiB,
    MemoryPlanError,
    RunShape,
    check_fits,
    estimate,
    estimate_asked,
    plan_memory,
    planned,
    smallest_world,
)
from modelopt_k3.models.kimi_k3 import KIMI_K3_SPEC
from modelopt_k3.recipe import load_recipe
from modelopt_k3.testing.header_only import KIMI_K3_SIZES, make_kimi_k3_layout

pytestmark = pytest.mark.usefixtures("restore_remote_code")


@pytest.fixture(scope="module")
def full_size(tmp_path_factory) -> Path:
    """Kimi-K3 at full size, sparse: every shard has its real size (holes, no data blocks), which the one
    validating reader requires (a header-only file is a truncated checkpoint)."""
    return make_kimi_k3_layout(tmp_path_factory.mktemp("k3") / "Kimi-K3", sparse=True)


def test_planner_reads_headers_only(tiny_ckpt: Path, monkeypatch) -> None:
    def no_data(*a, **k):
        raise AssertionError("the planner read tensor data")

    monkeypatch.setattr(CheckpointReader, "get", no_data)
    monkeypatch.setattr("safetensors.safe_open", no_data)
    report = plan_memory(tiny_ckpt, world_size=2, device="cpu", batch_size=2, calib_seq=32)
    table = report.table()
    assert "| expert_parallel, dense fsdp2 | packed | 2 |" in table
    assert "refused: plan 'fsdp2' gathers whole layers of experts" in table


@pytest.mark.parametrize("residency", ["bf16", "packed"])
def test_resident_figures_equal_a_loaded_model(tiny_ckpt: Path, residency: str) -> None:
    """Experts exactly (codes + scales, or decoded); the dense part within 1% (the remote code keeps a few
    fp32 parameters the planner counts in the load dtype)."""
    from modelopt_k3 import load_pretrained

    model = load_pretrained(tiny_ckpt, trust_remote_code=True, experts=residency, progress=False)
    experts = KIMI_K3_SPEC.experts_modules(model)
    expert_bytes = sum(t.nbytes for m in experts.values() for t in [*m.parameters(), *m.buffers()])
    dense_bytes = sum(p.nbytes for n, p in model.named_parameters() if not any(n.startswith(e) for e in experts))
    est = estimate_asked(read_layout(tiny_ckpt), Asked("whole", "replicated", residency, 1), RunShape(device="cpu"))
    assert est.resident_experts == expert_bytes
    assert est.resident_dense == pytest.approx(dense_bytes, rel=0.01)


def test_layout_generator_matches_a_real_tiny_checkpoint(tiny_ckpt: Path, tmp_path: Path) -> None:
    """At tiny sizes the header-only generator writes the tiny checkpoint's config and tensors exactly
    (names, dtypes, shapes): the full-size layout comes from the same remote code and rules."""
    from modelopt_k3.testing import TINY_DEFAULTS

    layout = make_kimi_k3_layout(tmp_path / "lay", sizes={k: TINY_DEFAULTS[k] for k in KIMI_K3_SIZES}, sparse=True)

    def tensors(path: Path) -> dict:
        index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        out = {}
        for file in set(index.values()):
            out.update({k: (v["dtype"], v["shape"]) for k, v in read_header(path / file).items() if k != "__metadata__"})
        return out

    assert tensors(layout) == tensors(tiny_ckpt)
    assert json.loads((layout / "config.json").read_text()) == json.loads((tiny_ckpt / "config.json").read_text())
    with CheckpointReader(layout) as reader:  # sparse: a valid checkpoint whose tensors read as zeros
        key = next(k for k in reader.names() if k.endswith("experts.3.w2.weight_packed"))
        assert not reader.get(key).any()


@pytest.mark.slow
def test_full_size_kimi_k3_fits_16_gpus_with_packed_experts_and_fsdp2_dense(full_size: Path) -> None:
    """Kimi-K3 (93 layers, 896 experts) calibrated in NVFP4 at batch 4 x 2048 tokens on 141 GiB GPUs:
    packed experts + FSDP2 dense fits 16; BF16 experts do not (the planner's numbers, in the README)."""
    layout = read_layout(full_size)
    assert len(layout.experts) == 92 and layout.num_experts == 896 and layout.packed_source
    shape, recipe, budget = RunShape(batch_size=4, calib_seq=2048), load_recipe("presets/nvfp4"), 141 * GiB
    packed = estimate_asked(layout, Asked("expert_parallel", "fsdp2", "packed", 16), shape, recipe=recipe, budget=budget)
    bf16 = estimate_asked(layout, Asked("expert_parallel", "fsdp2", "bf16", 16), shape, recipe=recipe, budget=budget)
    # 56 experts per rank per layer: three 3072x3584 MXFP4 matrices (codes + E8M0 scales) each.
    per_expert = 3 * 3072 * (3584 // 2 + 3584 // 32)
    assert packed.resident_experts == 92 * 56 * per_expert
    assert bf16.resident_experts == 92 * 56 * 3 * 3072 * 3584 * 2
    assert packed.workspace == 56 * 3 * 3072 * 3584 * 2 and packed.decode_chunk is None  # one whole layer
    assert packed.fits(budget) and not bf16.fits(budget), (packed.peak / GiB, bf16.peak / GiB)
    assert smallest_world(layout, "expert_parallel", "fsdp2", "packed", shape, recipe, 141) <= 16
    assert smallest_world(layout, "expert_parallel", "fsdp2", "bf16", shape, recipe, 141) > 16


def test_planner_picks_a_decode_chunk_when_a_layer_does_not_fit(tiny_ckpt: Path) -> None:
    layout, shape = read_layout(tiny_ckpt), RunShape(batch_size=2, calib_seq=32, device="cpu")
    cfg = planned(layout, Asked("whole", "replicated", "packed", 1), shape)
    layer, one = estimate(layout, cfg, shape), estimate(layout, cfg, shape, decode_chunk=1)
    assert layer.decode_chunk is None and one.decode_chunk == 1 and one.workspace * 8 == layer.workspace
    # A budget the whole layer misses at calibration (the stage the workspace lives in) and one expert meets.
    budget = (layer.stages["calibration"] + one.stages["calibration"]) // 2
    chosen = estimate(layout, cfg, shape, budget=budget)
    assert chosen.decode_chunk is not None and 1 <= chosen.decode_chunk < 8
    assert chosen.stages["calibration"] <= budget < layer.stages["calibration"]
    # the largest chunk that fits (the fewest decode passes), not merely one that does
    bigger = estimate(layout, cfg, shape, decode_chunk=chosen.decode_chunk + 1)
    assert bigger.stages["calibration"] > budget, (chosen.decode_chunk, bigger.stages, budget)
    assert chosen.decode_chunk > 1


def test_a_plan_fits_a_budget_it_exactly_uses(tiny_ckpt: Path) -> None:
    est = estimate_asked(read_layout(tiny_ckpt), Asked("whole", "replicated", "bf16", 1), RunShape(device="cpu"))
    assert est.fits(est.peak) is True and est.fits(est.peak - 1) is False and est.fits(None) is None


def test_fsdp2_rank_0_holds_the_rows_torch_chunk_gives_it() -> None:
    """torch.chunk's first piece of an odd dim is the larger one: rank 0 holds ceil(rows / world) rows."""
    import torch

    from modelopt_k3.memory.inventory import TensorMeta
    from modelopt_k3.memory.planner import _dense_bytes

    for rows, world in ((7, 2), (9, 4), (8, 2), (1, 2)):
        t = TensorMeta("layers.0.mlp.up_proj.weight", torch.bfloat16, (rows, 3))
        assert _dense_bytes(t, 2, world) == torch.chunk(torch.empty(rows, 3), world)[0].numel() * 2
    assert _dense_bytes(TensorMeta("w", torch.bfloat16, (7, 3)), 2, 1) == 7 * 3 * 2


def test_an_accelerator_gathers_the_next_fsdp2_unit_while_one_runs(tiny_ckpt: Path) -> None:
    """FSDP2 on a GPU: the largest unit counted twice (the next all-gather overlaps); on the host once."""
    layout = read_layout(tiny_ckpt)
    asked = Asked("expert_parallel", "fsdp2", "bf16", 2)
    dtype = layout.config_dtype
    units = {u: sum(t.numel * layout.load_dtype(t, dtype).itemsize for t in ts) for u, ts in layout.fsdp_units().items()}
    largest = max(b for u, b in units.items() if u)
    gpu = estimate_asked(layout, asked, RunShape(batch_size=2, calib_seq=32, device="cuda"))
    cpu = estimate_asked(layout, asked, RunShape(batch_size=2, calib_seq=32, device="cpu"))
    assert gpu.fsdp_gathered - cpu.fsdp_gathered == largest == cpu.fsdp_gathered - units[""]


def test_check_fits_resolves_auto_and_refuses_with_numbers(tiny_ckpt: Path) -> None:
    kw = dict(plan="whole", world_size=1, batch_size=2, calib_seq=32, device="cpu")
    fits = {r: check_fits(tiny_ckpt, experts=r, **kw).peak for r in ("bf16", "packed")}
    assert fits["packed"] < fits["bf16"]
    between = (fits["packed"] + fits["bf16"]) / 2 / GiB
    assert check_fits(tiny_ckpt, experts="auto", gpu_mem_gib=between, **kw).residency == "packed"
    assert check_fits(tiny_ckpt, experts="auto", gpu_mem_gib=64, **kw).residency == "bf16"
    with pytest.raises(MemoryPlanError, match=r"needs .* per rank at .* but .* is available: resident"):
        check_fits(tiny_ckpt, experts="bf16", gpu_mem_gib=between, **kw)


def test_hf_ptq_refuses_before_loading(tiny_ckpt: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    import modelopt_k3.load as load
    from modelopt_k3.cli import hf_ptq
    from modelopt_k3.cli._common import EXIT_REFUSED

    def must_not_load(*a, **k):
        raise AssertionError("hf_ptq loaded weights for a run that cannot fit")

    monkeypatch.setattr(load, "load_pretrained", must_not_load)
    code = hf_ptq.main(["--pyt_ckpt_path", str(tiny_ckpt), "--trust_remote_code", "--gpu_mem_gib", "0.1",
                        "--export_path", str(tmp_path / "out"), "--no_progress"])
    err = capsys.readouterr().err
    assert code == EXIT_REFUSED and "modelopt-k3-ptq: error:" in err, err
    assert "per rank at" in err and "is available: resident" in err and "runtime" in err, err
    assert not (tmp_path / "out").exists()


def test_plan_cli(tiny_ckpt: Path, capsys) -> None:
    from modelopt_k3.cli import plan

    assert plan.main(["--pyt_ckpt_path", str(tiny_ckpt), "--world_size", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "| plan | experts | ranks | resident |" in out and "largest resident module" in out
    assert plan.main(["--pyt_ckpt_path", str(tiny_ckpt), "--world_size", "2", "--gpu_mem_gib", "0.01"]) == 1


def test_plan_cli_plans_the_recipe_hf_ptq_would_use(tmp_path: Path, capsys) -> None:
    """``--qformat`` maps to the model's own recipe as hf_ptq maps it (GPT-OSS's nvfp4 is not the Kimi-K3 preset);
    ``--recipe`` overrides it."""
    from modelopt_k3.cli import plan
    from modelopt_k3.testing.tiny_gpt_oss import make_tiny_gpt_oss

    ckpt = make_tiny_gpt_oss(tmp_path / "gpt-oss")
    for argv, recipe in (([], "models/openai/gpt-oss/nvfp4"), (["--qformat", "nvfp4_gptq"],
                                                               "models/openai/gpt-oss/nvfp4_gptq"),
                         (["--recipe", "presets/fp8"], "presets/fp8")):
        assert plan.main(["--pyt_ckpt_path", str(ckpt), "--world_size", "1", "--device", "cpu", *argv]) == 0
        assert f", recipe {recipe}," in capsys.readouterr().out.splitlines()[0], argv


def test_plan_memory_is_lazy_public_api() -> None:
    import modelopt_k3

    assert modelopt_k3.plan_memory is plan_memory


def test_packed_experts_take_their_amax_from_codes_and_scales_not_decoded_weights(tiny_ckpt: Path) -> None:
    """Quantize setup, packed: the E2M1 codes (half a byte a weight) and one fp32 per 32-weight block, a
    fraction of the bf16 path's two fp32 copies of every weight: never more than bf16 (on the tiny model
    bf16's experts term, 8 x 2 x 128 x 64 x 4 bytes, is the largest; packed's is under a tenth of it)."""
    layout = read_layout(tiny_ckpt)
    shape = RunShape(batch_size=2, calib_seq=32, device="cpu")
    bf16 = estimate_asked(layout, Asked("whole", "replicated", "bf16", 1), shape)
    packed = estimate_asked(layout, Asked("whole", "replicated", "packed", 1), shape)
    assert bf16.amax_transient == 8 * 2 * 128 * 64 * 4
    assert packed.amax_transient < bf16.amax_transient


def test_layerwise_plan_fits_calibrated_kimi_k3_on_8_gpus_and_says_the_smallest_world(full_size, capsys):
    """Issue 28's target: calibrated NVFP4 (4 x 2048 tokens per rank) on 8 x 141 GiB with --layerwise; one
    decoder layer resident instead of the model, so every row's peak is below its resident twin's."""
    from modelopt_k3.cli import plan as plan_cli

    assert plan_cli.main(["--pyt_ckpt_path", str(full_size), "--world_size", "8", "--gpu_mem_gib", "141",
                          "--layerwise", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {tuple(r) for r in rows} == {("plan", "experts", "layerwise", "world_size", "peak_gib", "fits", "refused",
                                         "smallest_world", "weight_algorithm_gib")}
    by = {(r["plan"], r["experts"]): r for r in rows}
    ep = by[("expert_parallel, dense replicated", "bf16")]
    assert ep["layerwise"] and ep["world_size"] == 8 and ep["fits"] is True and ep["peak_gib"] < 141
    assert by[("whole", "bf16")]["smallest_world"] == 1  # one GPU holds one layer: the smallest world
    assert by[("fsdp2", "bf16")]["refused"] and by[("expert_parallel, dense fsdp2", "bf16")]["fits"] is False
    resident = plan_memory(full_size, world_size=8, gpu_mem_gib=141)
    assert not resident.find("expert_parallel", "replicated", "bf16").fits(resident.budget)
    layerwise = plan_memory(full_size, world_size=8, gpu_mem_gib=141, layerwise=True)
    for e in layerwise.estimates:
        if not e.refused:
            twin = resident.find(*e.asked[:3])
            assert e.peak < twin.peak, e.label()


@pytest.mark.slow
def test_the_eager_owners_planned_bytes_bound_its_measured_allocations_closely(tiny_ckpt: Path) -> None:
    """The planner's eager-owner term (``owner_bytes``: gathered inputs, outputs, the fp32 combine, one expert's
    rows through SituAndMul at a time) against the live tensors the tiny Kimi-K3's own experts forward allocates
    on 8192 routed rows: an upper bound, within 30% (1.18x measured). A coefficient off by one in it (3 fp32
    buffers per row instead of 2: 1.46x) or a term dropped falls outside."""
    import torch

    from modelopt_k3.load import load_pretrained
    from modelopt_k3.memory.planner import owner_bytes

    model = load_pretrained(tiny_ckpt, trust_remote_code=True, progress=False, dtype=torch.bfloat16, experts="bf16")
    experts = next(m for n, m in model.named_modules() if n.endswith("block_sparse_moe.experts"))
    num, hidden = experts.num_experts, experts.hidden_dim
    tokens, top_k = 4096, 2
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(num, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    live = LiveTensors()
    with torch.no_grad(), live.mode:
        experts(x, ids, weights)
    layout = read_layout(tiny_ckpt)
    # The spec's activation model at this shape: its per-row SituAndMul term, latent width and top-k.
    act = KIMI_K3_SPEC.memory.activation_memory(layout.text_config, 1, tokens, 2)
    assert (act.tokens, act.latent_dim, act.top_k) == (tokens, hidden, top_k)
    planned = owner_bytes("eager", tokens * top_k, act, layout.experts[0], 2, num)
    assert 1.0 <= planned / live.peak <= 1.3, (planned, live.peak)


def test_the_planner_plans_the_owner_implementation_the_run_decides(tiny_ckpt: Path) -> None:
    """One rule for the owner's experts implementation: grouped_mm for a bf16 load on a GPU, eager for an fp32
    one (torch's kernel takes bf16 only: ``default_local_implementation``); ``fit_plan`` sizes the plan's own."""
    import torch

    from modelopt_k3.dist.plan import decide_plan
    from modelopt_k3.memory.planner import fit_plan

    layout, asked = read_layout(tiny_ckpt), Asked("whole", "replicated", "bf16", 1)
    gpu = RunShape(batch_size=2, calib_seq=32, device="cuda")
    assert planned(layout, asked, gpu).local_experts_implementation == "grouped_mm"
    fp32 = RunShape(batch_size=2, calib_seq=32, device="cuda", dtype=torch.float32)
    assert planned(layout, asked, fp32).local_experts_implementation == "eager"
    # A GPU run whose plan runs its experts eager (fp32, or a device before sm80) is sized as eager.
    plan = decide_plan("whole", spec=layout.spec, num_experts=layout.num_experts, rank=0, world_size=1,
                       device=torch.device("cuda"), experts_implementation="eager")
    _, est = fit_plan(layout, plan, "bf16", gpu, recipe=load_recipe(gpu.recipe), gpu_mem_gib=64)
    assert est.moe_detail.startswith("eager on "), est.moe_detail
    _, est = fit_plan(layout, dataclasses.replace(plan, experts_implementation="grouped_mm",
                                                  local_experts_implementation="grouped_mm"),
                      "bf16", gpu, recipe=load_recipe(gpu.recipe), gpu_mem_gib=64)
    assert est.moe_detail.startswith("grouped_mm on "), est.moe_detail


def test_the_planner_sizes_the_runs_decision_table(tiny_ckpt: Path) -> None:
    """What is quantized is the run's decision table (the preflight's, passed on), not the planner's own match
    of the recipe: a table keeping every dense Linear unquantized plans no dense quantization work, and the
    layout's own table (no run's given) is the one ``decide`` makes of the same headers."""
    from modelopt_k3.quant.decisions import DecisionTable

    shape = RunShape(batch_size=2, calib_seq=32, device="cpu", recipe="presets/nvfp4_mse")
    layout = read_layout(tiny_ckpt)
    plan = planned(layout, Asked("whole", "replicated", "bf16", 1), shape)
    recipe = load_recipe(shape.recipe)
    table = layout.decision_table(recipe)
    assert any(d.kind == "linear" and d.quantized for d in table.decisions.values())
    kept = DecisionTable(recipe, {n: dataclasses.replace(d, format=None, reason="kept") if d.kind == "linear" else d
                                  for n, d in table.decisions.items()})
    own, run = estimate(layout, plan, shape, recipe=recipe), estimate(layout, plan, shape, table=kept)
    assert own.stages["export"] > run.stages["export"]  # no dense Linear's searched block scales held
    assert estimate(layout, plan, shape, table=table).peak == own.peak
    with pytest.raises(ValueError, match="decision table is for recipe"):
        estimate(layout, plan, shape, recipe=load_recipe("presets/fp8"), table=table)


def test_a_recipe_the_run_refuses_is_refused_by_the_plan(tmp_path: Path) -> None:
    """The planner decides the table as the run's preflight does (``decide``), so a recipe that does not fit the
    model (a ``must_match`` pattern matching nothing) is refused by ``modelopt-k3-plan`` too, not planned."""
    from modelopt_k3.recipe import RecipeError
    from modelopt_k3.testing import make_tiny

    ckpt = make_tiny("qwen3_moe", tmp_path / "qwen3")
    with pytest.raises(RecipeError, match="must_match"):
        plan_memory(ckpt, world_size=1, device="cpu", batch_size=2, calib_seq=32, recipe="presets/nvfp4_experts_only")
