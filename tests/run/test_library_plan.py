"""The library conveniences take the run's one path (issue 39 item 1; decision 0016): ``load_pretrained`` builds
a ``RunPlan`` with the preflight's own planning steps and loads it with ``load_planned``; ``quantize(table=None)``
takes that plan's decision table (or the one builder, ``run_table``); the engine pre-check without a table
decides as the preflight does; the layerwise cache limit is a plan setting, defaulted from the environment only
by the command line."""

from __future__ import annotations

import ast
import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import torch

import modelopt_k3
from modelopt_k3.export.layouts import export_format
from modelopt_k3.memory import planner
from modelopt_k3.quant import decisions
from modelopt_k3.run.planning import library_config
from modelopt_k3.run.preflight import PreflightContext, run_preflight

PACKAGE = Path(modelopt_k3.__file__).parent


@pytest.fixture(scope="module")
def deepseek_mtp_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A block-FP8 DeepSeek-V3 stand-in with one MTP layer (a carried module the model does not build)."""
    from modelopt_k3.testing.deepseek_v3 import make_tiny_deepseek_v3

    return make_tiny_deepseek_v3(tmp_path_factory.mktemp("ds_mtp") / "ckpt", source="block_fp8",
                                 num_nextn_predict_layers=1)


def _hf_ptq_plan(config, export: Path):
    """The ``RunPlan`` hf_ptq's preflight makes of ``config`` (one process, on this run group's device)."""
    from modelopt_k3.dist.group import current_group

    ctx = PreflightContext(dataclasses.replace(config, export_path=export), config.pyt_ckpt_path, True,
                           export_format(config.export_format), device=current_group().device)
    try:
        run_preflight(ctx)
        return ctx.run_plan()
    finally:
        ctx.close()


def _load_args(ckpt: Path, dtype, experts: str) -> dict:
    return dict(plan="whole", trust_remote_code=True, dtype=dtype, ep_degree=None, dense="replicated",
                experts=experts, allow_nonfinite_passthrough=False)


CASES = {
    "kimi_k3-bf16": ("tiny_ckpt", torch.bfloat16, "bf16"),
    "kimi_k3-packed": ("tiny_ckpt", torch.bfloat16, "packed"),
    "deepseek_v3-fp32": ("deepseek_mtp_ckpt", torch.float32, "auto"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_load_pretrained_plans_what_hf_ptq_plans(case, request, tmp_path, monkeypatch):
    """Same inputs, same plan: dtype, distribution plan (kind, residency, decode chunk, experts implementations),
    recipe, decision table and memory estimate; the model is loaded through that plan, made by the steps the
    preflight runs (each called once by the load)."""
    import modelopt_k3.run.planning as planning

    fixture, dtype, experts = CASES[case]
    ckpt = request.getfixturevalue(fixture)
    calls: Counter = Counter()
    for name in ("plan_distribution", "plan_memory", "read_source"):
        original = getattr(planning, name)

        def counted(*a, _name=name, _fn=original, **k):
            calls[_name] += 1
            return _fn(*a, **k)

        monkeypatch.setattr(planning, name, counted)
    model = modelopt_k3.load_pretrained(ckpt, **{k: v for k, v in _load_args(ckpt, dtype, experts).items()
                                                 if k != "allow_nonfinite_passthrough"}, progress=False)
    assert calls == Counter(plan_distribution=1, plan_memory=1, read_source=1)  # the load's one plan, no other
    lib = model.modelopt_k3.run
    hf = _hf_ptq_plan(library_config(ckpt, **_load_args(ckpt, dtype, experts)), tmp_path / "out")
    assert lib.dtype == hf.dtype == dtype
    assert lib.distribution == hf.distribution and model.modelopt_k3.plan is lib.distribution
    assert lib.distribution.experts_residency == (experts if experts != "auto" else "bf16")
    assert (lib.distribution.decode_chunk, lib.distribution.experts_implementation,
            lib.distribution.local_experts_implementation) == (hf.distribution.decode_chunk,
                                                               hf.distribution.experts_implementation,
                                                               hf.distribution.local_experts_implementation)
    assert lib.recipe == hf.recipe and lib.table.decisions == hf.table.decisions
    assert lib.memory.peak == hf.memory.peak and lib.memory.decode_chunk == hf.memory.decode_chunk
    assert {p.dtype for n, p in model.named_parameters() if p.is_floating_point() and "experts" not in n} >= {dtype}


def test_without_a_dtype_the_load_and_hf_ptq_take_the_configs(copy_ckpt, tmp_path):
    """No dtype given: both take config.json's (transformers' rule, ``load_dtype``), here float32."""

    def to_fp32(config: dict) -> None:
        config["dtype"] = "float32"
        config.get("text_config", {})["dtype"] = "float32"

    ckpt = copy_ckpt(edit_config=to_fp32)
    model = modelopt_k3.load_pretrained(ckpt, plan="whole", trust_remote_code=True, progress=False)
    hf = _hf_ptq_plan(library_config(ckpt, **_load_args(ckpt, None, "auto")), tmp_path / "out")
    assert model.modelopt_k3.run.dtype == hf.dtype == torch.float32
    assert model.modelopt_k3.plan == hf.distribution
    assert model.get_input_embeddings().weight.dtype == torch.float32


def test_auto_residency_and_decode_chunk_agree_where_bf16_does_not_fit(tiny_ckpt, tmp_path, monkeypatch):
    """``experts="auto"`` with a budget between the two residencies' peaks: the load and hf_ptq both choose
    packed experts, with the same decode chunk (the planner's, once)."""
    layout = planner.read_layout(tiny_ckpt)
    shape = planner.RunShape(device="cpu", dtype=torch.bfloat16)
    peaks = {r: planner.estimate_asked(layout, planner.Asked("whole", "replicated", r, 1), shape).peak
             for r in ("bf16", "packed")}
    monkeypatch.setattr(planner, "device_budget", lambda *a: (peaks["bf16"] + peaks["packed"]) // 2)
    model = modelopt_k3.load_pretrained(tiny_ckpt, plan="whole", trust_remote_code=True, dtype=torch.bfloat16,
                                        progress=False)
    hf = _hf_ptq_plan(library_config(tiny_ckpt, **_load_args(tiny_ckpt, torch.bfloat16, "auto")), tmp_path / "o")
    assert model.modelopt_k3.plan == hf.distribution
    assert hf.distribution.experts_residency == "packed"


def test_load_pretrained_keeps_its_refusals(tiny_ckpt):
    from modelopt_k3.dist.plan import PlanError, ResidencyError

    with pytest.raises(PlanError, match="unknown plan 'tensor_parallel'"):
        modelopt_k3.load_pretrained(tiny_ckpt, plan="tensor_parallel", trust_remote_code=True, progress=False)
    with pytest.raises(PlanError, match="unknown dense sharding"):
        modelopt_k3.load_pretrained(tiny_ckpt, dense="all", trust_remote_code=True, progress=False)
    with pytest.raises(ResidencyError, match="unknown experts residency 'int4'"):
        modelopt_k3.load_pretrained(tiny_ckpt, experts="int4", trust_remote_code=True, progress=False)
    with pytest.raises(ValueError, match="dtype=torch.float16"):
        modelopt_k3.load_pretrained(tiny_ckpt, dtype=torch.float16, trust_remote_code=True, progress=False)


def _forward(model: torch.nn.Module) -> None:
    vocab = model.config.get_text_config().vocab_size
    with torch.no_grad():
        model(torch.arange(16).remainder(vocab).reshape(2, 8))


def _decide_calls(monkeypatch) -> Counter:
    calls: Counter = Counter()
    original = decisions.decide

    def counted(*a, **k):
        calls["decide"] += 1
        return original(*a, **k)

    monkeypatch.setattr(decisions, "decide", counted)
    return calls


def test_quantize_without_a_table_takes_the_plans_table(tiny_ckpt, monkeypatch):
    """The recipe the load planned: its table, not a second ``decide``; another recipe: ``run_table`` (what the
    plan's table was made with) on the load's reader, nothing else."""
    model = modelopt_k3.load_pretrained(tiny_ckpt, trust_remote_code=True, progress=False)
    run = model.modelopt_k3.run
    calls = _decide_calls(monkeypatch)
    modelopt_k3.quantize(model, run.recipe.name, _forward, verbose=False)  # the name, loaded again: equal
    assert calls["decide"] == 0
    qplan = model.modelopt_k3_quant
    assert qplan.recipe is run.recipe
    assert {k: (d.kind, d.format, d.reason) for k, d in qplan.table.decisions.items()} == {
        k: (d.kind, d.format, d.reason) for k, d in run.table.decisions.items()}

    other = modelopt_k3.load_pretrained(tiny_ckpt, trust_remote_code=True, progress=False)
    assert calls["decide"] == 1  # the load's plan: its table, for its recipe
    modelopt_k3.quantize(other, "presets/fp8", _forward, verbose=False)
    assert calls["decide"] == 2  # another recipe: one table, by the builder
    want = decisions.run_table(run.reader.inventory(), run.spec, other.modelopt_k3_quant.recipe, run.source.carried)
    assert {k: (d.kind, d.format) for k, d in other.modelopt_k3_quant.table.decisions.items()} == {
        k: (d.kind, d.format) for k, d in want.decisions.items()}


def test_the_engine_precheck_without_a_table_decides_as_the_preflight(deepseek_mtp_ckpt, tmp_path):
    """``planned_layout(ckpt, recipe)`` (no table: a library call) equals the layout of the preflight's own
    reader and table: the checkpoint view and the carried MTP layer (kept as stored, never quantized)."""
    from modelopt_k3.check.layout import planned_layout

    config = library_config(deepseek_mtp_ckpt, **_load_args(deepseek_mtp_ckpt, None, "auto"))
    hf = _hf_ptq_plan(config, tmp_path / "out")
    alone = planned_layout(deepseek_mtp_ckpt, hf.recipe)
    run = planned_layout(deepseek_mtp_ckpt, hf.recipe, reader=hf.reader, table=hf.table, config=hf.raw_config)
    assert alone.tensors == run.tensors and alone.hf_quant == run.hf_quant
    assert any(hf.source.carried.holds(n) for n in alone.linears)  # the MTP layer is in it, as the run writes it


def test_the_layerwise_cache_limit_is_a_plan_setting(monkeypatch):
    """``--layerwise_cache_mib`` takes ``$MODELOPT_K3_LAYERWISE_CACHE_MIB`` as its default when the parser is
    built; the plan's ``LayerwiseSettings`` carries it; the flag wins."""
    from modelopt_k3.cli.hf_ptq import LAYERWISE_CACHE_ENV, build_parser
    from modelopt_k3.recipe import load_recipe
    from modelopt_k3.run.plan import LAYERWISE_CACHE_MIB, PtqConfig, layerwise_settings

    recipe = load_recipe("presets/nvfp4")
    monkeypatch.delenv(LAYERWISE_CACHE_ENV, raising=False)
    assert PtqConfig.from_namespace(build_parser().parse_args(["--layerwise"])).layerwise_cache_mib == LAYERWISE_CACHE_MIB
    monkeypatch.setenv(LAYERWISE_CACHE_ENV, "7")
    config = PtqConfig.from_namespace(build_parser().parse_args(["--layerwise"]))
    assert layerwise_settings(config, recipe).cache_bytes == 7 * 2**20
    flag = PtqConfig.from_namespace(build_parser().parse_args(["--layerwise", "--layerwise_cache_mib", "3"]))
    assert layerwise_settings(flag, recipe).cache_bytes == 3 * 2**20
    with pytest.raises(ValueError, match="layerwise_cache_mib"):
        PtqConfig(layerwise_cache_mib=0)


def test_run_layerwise_spills_at_the_plans_limit_whatever_the_environment(tiny_ckpt, tmp_path, monkeypatch):
    """The layerwise stage takes the limit from the plan: an environment set after the parser ran changes
    nothing."""
    import modelopt_k3.layerwise as layerwise
    from modelopt_k3.cli import hf_ptq
    from modelopt_k3.layerwise import replay

    limits = []
    original = replay.InputCache.__init__

    def record(self, spill_dir, limit_bytes, tag):
        limits.append(limit_bytes)
        original(self, spill_dir, limit_bytes, tag)

    monkeypatch.setattr(replay.InputCache, "__init__", record)
    args = hf_ptq.build_parser().parse_args([
        "--pyt_ckpt_path", str(tiny_ckpt), "--trust_remote_code", "--export_path", str(tmp_path / "out"),
        "--calib_size", "2", "--batch_size", "2", "--calib_seq", "16", "--no_progress", "--report", "none",
        "--layerwise", "--layerwise_cache_mib", "1"])
    monkeypatch.setenv("MODELOPT_K3_LAYERWISE_CACHE_MIB", "999")
    assert hf_ptq.run(args) == 0
    assert limits and set(limits) == {2**20}
    assert "os" not in vars(layerwise)


# Environment reads that are process configuration, not a run's settings (decision 0010, 0016): torchrun's own
# variables and the group timeout, the recipe search path, the lock staleness knob, a model's kernel switch, and
# the command lines (which turn the launcher's variables into their flags' defaults).
PROCESS_ENV = {"dist/group.py", "recipe/finder.py", "files/locks.py", "models/kimi_k3/fla_cpu.py",
               "memory/planner.py"}  # the planner: LOCAL_WORLD_SIZE (ranks sharing a host's RAM)


def test_no_stage_reads_run_settings_from_the_environment():
    readers = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("cli/") or "remote_code" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.add(rel)
    assert readers <= PROCESS_ENV, sorted(readers - PROCESS_ENV)


# The only functions that read a run's load or quantization plan off the model: the library's conveniences.
MODEL_ATTRIBUTE_READERS = {("quant/api.py", "loaded_facts"), ("quant/api.py", "quantized_plan"),
                           ("quant/api.py", "quantize")}


def _model_attribute_reads(tree: ast.AST) -> set[str]:
    """The functions (innermost enclosing name) of ``tree`` that read ``.modelopt_k3``/``.modelopt_k3_quant``,
    as an attribute or through ``getattr(x, "...")``."""
    found = set()

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where = node.name
        reads = (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                 and node.attr in ("modelopt_k3", "modelopt_k3_quant")) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
            and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in ("modelopt_k3", "modelopt_k3_quant"))
        if reads:
            found.add(where)
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(tree, "<module>")
    return found


def test_no_stage_reads_the_run_off_the_model():
    """Load, quantize, export, report and the calibrators take the load and the quantization plan as arguments;
    only the library's conveniences take them off the model ``load_pretrained``/``quantize`` returned."""
    readers = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if "remote_code" in path.parts:
            continue
        readers |= {(rel, fn) for fn in _model_attribute_reads(ast.parse(path.read_text()))}
    assert readers == MODEL_ATTRIBUTE_READERS, sorted(readers ^ MODEL_ATTRIBUTE_READERS)
    planted = ast.parse("def stage(model):\n    return getattr(model, 'modelopt_k3_quant', None)\n")
    assert _model_attribute_reads(planted) == {"stage"}  # the scan sees a getattr read


def test_the_stages_need_nothing_on_the_model(tiny_ckpt, tmp_path):
    """hf_ptq's stages on a model stripped of what the library leaves on it (``modelopt_k3``): the load's result,
    then the quantize stage's, passed on, give the library path's export byte for byte and its report."""
    from _exports import read_export

    from modelopt_k3.dist.group import current_group
    from modelopt_k3.export.model_export import export_planned
    from modelopt_k3.load import load_planned
    from modelopt_k3.quant.api import quantize_planned
    from modelopt_k3.report import report_planned

    lib = modelopt_k3.load_pretrained(tiny_ckpt, trust_remote_code=True, progress=False)
    run = lib.modelopt_k3.run
    modelopt_k3.quantize(lib, run.recipe, _forward, verbose=False)
    want = modelopt_k3.export_checkpoint(lib, tmp_path / "library", progress=False)
    want_report = modelopt_k3.report(lib, None)

    model, info = load_planned(run, progress=False)
    del model.modelopt_k3
    qplan = quantize_planned(model, info, run.recipe, _forward, table=run.table, verbose=False)
    assert not hasattr(model, "modelopt_k3_quant") and qplan.load is info
    group = current_group()
    got = export_planned(model, qplan, tmp_path / "stages", export_format("modelopt"), group=group, progress=False)
    mine, theirs = read_export(got), read_export(want)
    assert mine.keys() == theirs.keys()
    assert all(mine[k].dtype == theirs[k].dtype and mine[k].shape == theirs[k].shape
               and mine[k].reshape(-1).view(torch.uint8).equal(theirs[k].reshape(-1).view(torch.uint8)) for k in mine)
    assert (got / "config.json").read_bytes() == (want / "config.json").read_bytes()
    assert (got / "hf_quant_config.json").read_bytes() == (want / "hf_quant_config.json").read_bytes()
    got_report = report_planned(model, qplan, None, group=group)
    assert got_report["modules"] == want_report["modules"] and got_report["experts"] == want_report["experts"]
