"""The preflight's single checks and the ``RunPlan`` decisions, each against the case that tells a right
answer from a plausible wrong one (issue 33: the boundary, the flag that must win, the sequences a check
must count)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from modelopt_k3.recipe.algorithm import parse_algorithm
from modelopt_k3.run import preflight
from modelopt_k3.run.plan import PtqConfig, layerwise_settings
from modelopt_k3.run.preflight import PreflightContext, PreflightError


def _ctx(config: PtqConfig, raw: dict | None = None, **kw) -> PreflightContext:
    ctx = PreflightContext(config, Path("src"), True, None, **kw)
    ctx.raw_config = raw
    return ctx


def test_calib_seq_may_equal_max_position_embeddings_not_pass_it():
    raw = {"text_config": {"max_position_embeddings": 16}}
    preflight._calib_seq_within_positions(_ctx(PtqConfig(calib_seq=16), raw))  # exactly the limit: fine
    with pytest.raises(PreflightError, match="--calib_seq 17 is longer than the model's max_position_embeddings = 16"):
        preflight._calib_seq_within_positions(_ctx(PtqConfig(calib_seq=17), raw))


def test_the_calibration_size_check_counts_the_report_heldout_sequences(monkeypatch):
    """32 calibration + 8 held-out sequences of 128 tokens: 81920 bytes of ids. A host of 288 KiB allows a
    quarter (73728 bytes): the 32 alone (65536) fit, with --report_heldout 8 they do not."""
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 72}
    monkeypatch.setattr(preflight.os, "sysconf", lambda name: pages[name])
    preflight._calibration_size(_ctx(PtqConfig()))
    with pytest.raises(PreflightError, match=r"\+ 8 held out"):
        preflight._calibration_size(_ctx(PtqConfig(report_heldout=8)))
    with pytest.raises(PreflightError, match=r"\+ 8 held out"):
        preflight._calibration_size(_ctx(PtqConfig(eval_kl=8)))


def test_the_layerwise_checkpoint_flag_wins_over_the_recipes_directory(tmp_path: Path):
    recipe = SimpleNamespace(algorithm=parse_algorithm(
        {"method": "max", "layerwise": {"enable": True, "checkpoint_dir": str(tmp_path / "recipe")}}))
    flag = layerwise_settings(PtqConfig(layerwise_checkpoint_dir=tmp_path / "flag"), recipe)
    assert flag.checkpoint_dir == tmp_path / "flag"
    assert layerwise_settings(PtqConfig(), recipe).checkpoint_dir == tmp_path / "recipe"
    gptq = SimpleNamespace(algorithm=parse_algorithm("gptq"))
    assert layerwise_settings(PtqConfig(layerwise=True), gptq).qdq_inputs
    assert layerwise_settings(PtqConfig(), gptq) is None


@pytest.mark.parametrize(("export", "ckpt"), [("out", "out/ck"), ("ck/out", "ck"), ("out", "out")],
                         ids=["inside the export", "holding the export", "the export itself"])
def test_a_layerwise_checkpoint_dir_overlapping_the_export_either_way_is_refused(tmp_path: Path, export, ckpt):
    ctx = _ctx(PtqConfig(layerwise=True, layerwise_checkpoint_dir=tmp_path / ckpt), {})
    ctx.checkpoint, ctx.export_path = tmp_path / "src", tmp_path / export
    ctx.recipe = SimpleNamespace(algorithm=parse_algorithm("max"))
    ctx.distribution = SimpleNamespace(layerwise_refusal=lambda: None)  # an unsharded plan
    with pytest.raises(PreflightError, match="overlaps the export path"):
        preflight._layerwise(ctx)
    ctx.config = PtqConfig(layerwise=True, layerwise_checkpoint_dir=tmp_path / "beside")
    preflight._layerwise(ctx)  # a directory beside the export: fine
    assert ctx.layerwise.checkpoint_dir == tmp_path / "beside"


@pytest.mark.parametrize(("flag", "want"), [((), torch.bfloat16), (("--dtype", "float32"), torch.float32)])
def test_the_run_plan_loads_in_the_dtype_flag_else_the_configs(tiny_ckpt: Path, tmp_path: Path, flag, want):
    from modelopt_k3.cli.hf_ptq import _preflight, build_parser
    from modelopt_k3.export.layouts import MODELOPT

    argv = ["--pyt_ckpt_path", str(tiny_ckpt), "--trust_remote_code", "--export_path", str(tmp_path / "out"),
            "--calib_size", "2", "--batch_size", "2", "--calib_seq", "16", *flag]
    group = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    ctx = _preflight(PtqConfig.from_namespace(build_parser().parse_args(argv)), MODELOPT, group, tiny_ckpt, True)
    try:
        plan = ctx.run_plan()
    finally:
        ctx.close()
    assert plan.dtype is want


# A library caller's preflight, in a fresh interpreter that imports only ``run.preflight`` (not the CLI, not
# ``check``, not ``memory.preflight``): the checks it runs are the listed ones, the feature checks included.
_LIBRARY_PREFLIGHT = """
import sys
from pathlib import Path

from modelopt_k3.export.layouts import export_format
from modelopt_k3.run.plan import PtqConfig
from modelopt_k3.run.preflight import PreflightContext, PreflightError, run_preflight

ckpt, out = Path(sys.argv[1]), Path(sys.argv[2])
small = dict(pyt_ckpt_path=ckpt, trust_remote_code=True, calib_size=2, batch_size=2, calib_seq=16)
config = PtqConfig(export_path=out / "a", **small)
ctx = PreflightContext(config, ckpt, True, export_format(config.export_format))
run_preflight(ctx)
ctx.close()
print("memory:", type(ctx.memory).__name__)
config = PtqConfig(export_path=out / "b", export_format="compressed-tensors", target_engines="vllm", **small)
ctx = PreflightContext(config, ckpt, True, export_format(config.export_format))
try:
    run_preflight(ctx)
    print("engines: passed")
except PreflightError as e:
    print("engines:", e)
print("cli imported:", any(m.startswith("modelopt_k3.cli") for m in sys.modules))
"""


def test_a_library_preflight_runs_the_memory_and_engine_checks(tiny_ckpt: Path, tmp_path: Path):
    import os
    import subprocess
    import sys

    import modelopt_k3

    root = str(Path(modelopt_k3.__file__).parents[1])  # the package this test runs against
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _LIBRARY_PREFLIGHT, str(tiny_ckpt), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "memory: Estimate" in lines  # the memory check planned the run (None without it)
    assert "engines: --target_engines replays the engines' ModelOpt loaders, not compressed-tensors's; it needs " \
           "--export_format modelopt" in lines  # the serving-engines check ran (and refused)
    assert "cli imported: False" in lines


def test_the_checks_are_one_ordered_list():
    names = [c.name for c in preflight.CHECKS]
    assert len(set(names)) == len(names)
    assert names[0] == "source checkpoint"  # every later check reads the spec and recipe it decides
    for before, after in (("export format", "serving engines"), ("distribution plan", "layerwise"),
                          ("layerwise", "memory plan fits"), ("memory plan fits", "wall time")):
        assert names.index(before) < names.index(after), (before, after)


@pytest.mark.parametrize(("kind", "dense"), [("fsdp2", "replicated"), ("expert_parallel", "fsdp2")])
def test_the_layerwise_fsdp2_refusal_is_one_and_said_alike_everywhere(tiny_ckpt: Path, kind, dense):
    """The preflight, the layerwise loader and the planner's table refuse a layerwise run on an FSDP2-sharded
    plan with the plan's one refusal (``DistributionPlan.layerwise_refusal``); an unsharded plan passes."""
    from modelopt_k3.dist.plan import decide_plan
    from modelopt_k3.load.layerwise import LayerwiseLoad
    from modelopt_k3.memory.inventory import read_layout
    from modelopt_k3.memory.planner import Asked, RunShape, estimate_asked

    layout = read_layout(tiny_ckpt)
    plan = decide_plan(kind, spec=layout.spec, num_experts=layout.num_experts, rank=0, world_size=2,
                       device=torch.device("cpu"), dense=dense)
    why = plan.layerwise_refusal()
    assert why is not None and "FSDP2" in why and "--plan whole" in why
    whole = decide_plan("whole", spec=layout.spec, num_experts=layout.num_experts, rank=0, world_size=1,
                        device=torch.device("cpu"))
    assert whole.layerwise_refusal() is None

    ctx = _ctx(PtqConfig(layerwise=True), {})
    ctx.recipe = SimpleNamespace(algorithm=parse_algorithm("max"))
    ctx.distribution = plan
    with pytest.raises(PreflightError) as refused:
        preflight._layerwise(ctx)
    assert str(refused.value) == why
    with pytest.raises(ValueError) as refused:
        LayerwiseLoad(SimpleNamespace(distribution=plan))
    assert str(refused.value) == why
    shape = RunShape(batch_size=2, calib_seq=32, device="cpu", layerwise=True)
    assert estimate_asked(layout, Asked(kind, dense, "bf16", 2), shape).refused == why
