"""load_pretrained on the tiny Kimi-K3 stand-in: fused experts, numerics against the independent
reference (compressed-tensors decode, unpatched remote code), converters, refusals, prepare, reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers.core_model_loading import rename_source_key

from modelopt_k3.checkpoint import CheckpointError, CheckpointReader
from modelopt_k3.checkpoint.source_check import SourceMismatchError
from modelopt_k3.dist.group import RunGroup
from modelopt_k3.dist.placement import ExpertPlacement
from modelopt_k3.dist.plan import PlanError, decide_plan
from modelopt_k3.load import LoadError, load_pretrained, resolve_model_class
from modelopt_k3.models.kimi_k3 import KIMI_K3_SPEC, KimiK3Experts, kimi_k3_converters
from modelopt_k3.models.kimi_k3.experts import experts_implementations_available
from modelopt_k3.models.kimi_k3.prepare import BLOCK_CLASS, find_block_module, unprepare
from modelopt_k3.spec import PrepareContext, SpecError
from modelopt_k3.spec.conversion import run_converter
from modelopt_k3.testing.reference import read_checkpoint, reference_logits

pytestmark = pytest.mark.usefixtures("restore_remote_code")

LAYERS = "language_model.model.layers"
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def _load(path: Path, **kwargs) -> torch.nn.Module:
    kwargs.setdefault("trust_remote_code", True)
    return load_pretrained(path, progress=False, **kwargs)


def _moe_blocks(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if n.endswith(".block_sparse_moe")}


def _text_config(tiny_ckpt: Path) -> dict:
    return json.loads((tiny_ckpt / "config.json").read_text())["text_config"]


def _remote(path: Path) -> tuple[type, object]:
    raw = json.loads((path / "config.json").read_text())
    KIMI_K3_SPEC.loading.build(path)
    return resolve_model_class(path, raw, trust_remote_code=True)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1234))  # 64 tokens


@pytest.fixture(scope="module")
def ref_logits(tiny_reference: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return reference_logits(tiny_reference, input_ids)


@pytest.fixture(scope="module")
def loaded_f32(tiny_ckpt: Path, tiny_reference: torch.nn.Module) -> torch.nn.Module:
    # tiny_reference first: it must be built from the unpatched class.
    return _load(tiny_ckpt, dtype=torch.float32)


@pytest.fixture(scope="module")
def loaded_bf16(tiny_ckpt: Path, tiny_reference: torch.nn.Module) -> tuple[torch.nn.Module, list]:
    """Default-dtype load, with every CheckpointReader.get in the process recorded (prepare included)."""
    reads: list[tuple[str, int]] = []
    real_get = CheckpointReader.get

    def spy(self: CheckpointReader, key: str) -> torch.Tensor:
        reads.append((key, self.info(key).nbytes))
        return real_get(self, key)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CheckpointReader, "get", spy)
        model = _load(tiny_ckpt)
    return model, reads


# ------------------------------------------------------------------------------------------------
# Fused experts and numerics
# ------------------------------------------------------------------------------------------------


def test_every_moe_block_has_fused_experts(loaded_f32: torch.nn.Module, tiny_ckpt: Path) -> None:
    cfg = _text_config(tiny_ckpt)
    e, i, dl = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["routed_expert_hidden_size"]
    blocks = _moe_blocks(loaded_f32)
    assert len(blocks) == cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    for name, block in blocks.items():
        experts = block.experts
        assert isinstance(experts, KimiK3Experts), name
        assert tuple(experts.gate_up_proj.shape) == (e, 2 * i, dl), name
        assert tuple(experts.down_proj.shape) == (e, dl, i), name
        assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float32
        assert (len(experts), experts.expert_offset, experts.num_global_experts) == (e, 0, e)
        # The block keeps the attributes the remote code and outside tools read.
        assert (block.ep_size, block.ep_rank, block.experts_per_rank) == (1, 0, e)
        assert hasattr(block, "gate") and hasattr(block, "shared_experts")
    assert not any(
        isinstance(m, torch.nn.ModuleList) and n.endswith(".experts") for n, m in loaded_f32.named_modules()
    )
    info = loaded_f32.modelopt_k3
    assert info.plan.kind == "whole" and info.spec is KIMI_K3_SPEC and info.checkpoint == tiny_ckpt


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_logits_match_reference(
    impl: str, loaded_f32: torch.nn.Module, input_ids: torch.Tensor, ref_logits: torch.Tensor
) -> None:
    if impl not in experts_implementations_available("cpu"):
        pytest.skip(f"{impl} not offered by this torch build")
    text = loaded_f32.config.text_config
    previous = text._experts_implementation
    text._experts_implementation = impl
    try:
        # Every fused module dispatches through this very config object.
        assert all(b.experts.config is text for b in _moe_blocks(loaded_f32).values())
        with torch.no_grad():
            logits = loaded_f32(input_ids=input_ids, use_cache=False).logits
    finally:
        text._experts_implementation = previous
    assert logits.shape == ref_logits.shape
    assert _rel_err(logits, ref_logits) < 1e-5, impl


def test_experts_implementation_argument(tiny_ckpt: Path, tiny_reference: torch.nn.Module) -> None:
    model = _load(tiny_ckpt, dtype=torch.float32, experts_implementation="batched_mm")
    assert model.config.text_config._experts_implementation == "batched_mm"
    assert model.modelopt_k3.plan.experts_implementation == "batched_mm"


def test_fused_weights_equal_reference_experts(
    loaded_f32: torch.nn.Module, tiny_reference: torch.nn.Module
) -> None:
    ref_blocks = _moe_blocks(tiny_reference)
    blocks = _moe_blocks(loaded_f32)
    assert blocks.keys() == ref_blocks.keys()
    for name, block in blocks.items():
        ref = ref_blocks[name].experts
        inter = block.experts.intermediate_dim
        gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
        assert len(ref) == gate_up.shape[0]
        for e, expert in enumerate(ref):
            assert torch.equal(gate_up[e, :inter], expert.w1.weight), f"{name}.experts.{e}.w1"
            assert torch.equal(gate_up[e, inter:], expert.w3.weight), f"{name}.experts.{e}.w3"
            assert torch.equal(down[e], expert.w2.weight), f"{name}.experts.{e}.w2"


# ------------------------------------------------------------------------------------------------
# Converters
# ------------------------------------------------------------------------------------------------


def test_converter_patterns_match_only_routed_experts(tiny_ckpt: Path) -> None:
    converters = kimi_k3_converters(packed=True)
    keys = list(read_checkpoint(tiny_ckpt))
    prefix = f"{LAYERS}.1.block_sparse_moe"
    near_misses = [
        f"{prefix}.shared_experts.gate_proj.weight",
        f"{prefix}.shared_experts.up_proj.weight",
        f"{prefix}.shared_experts.down_proj.weight",
        f"{prefix}.routed_expert_down_proj.weight",
        f"{prefix}.routed_expert_up_proj.weight",
        f"{prefix}.routed_expert_norm.weight",
        f"{prefix}.gate.weight",
        f"{prefix}.experts.0.w1.weight",  # plain: not what the packed converters read
        f"{LAYERS}.0.mlp.gate_proj.weight",
    ]
    assert set(near_misses[:7]) <= set(keys)
    expert_re = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight_packed|weight_scale)$")
    for key in keys + near_misses:
        renamed, pattern = rename_source_key(key, [], converters)
        m = expert_re.search(key)
        if m is None:
            assert pattern is None and renamed == key, key
            continue
        target = "gate_up_proj" if m[2] in ("w1", "w3") else "down_proj"
        assert pattern is not None, key
        assert renamed == key[: m.start()] + f".block_sparse_moe.experts.{target}", key
        assert m[2] in pattern and m[3] in pattern


@pytest.mark.parametrize("layer", [1, 3])
def test_converter_chain_gives_fused_tensor(
    tiny_ckpt: Path, tiny_reference: torch.nn.Module, layer: int
) -> None:
    tensors = read_checkpoint(tiny_ckpt)
    ref = _moe_blocks(tiny_reference)[f"{LAYERS}.{layer}.block_sparse_moe"].experts
    gate_up, down = kimi_k3_converters(packed=True)
    module = f"{LAYERS}.{layer}.block_sparse_moe.experts"

    def grouped(conv) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {p: [] for p in conv.source_patterns}
        for e in range(len(ref)):
            for proj in ("w1", "w3", "w2"):
                for t in ("weight_packed", "weight_scale"):
                    key = f"{module}.{e}.{proj}.{t}"
                    _, pattern = conv.rename_source_key(key)
                    if pattern is not None:
                        out[pattern].append(tensors[key])
        assert all(len(v) == len(ref) for v in out.values())
        return out

    fused_gate_up = run_converter(gate_up, grouped(gate_up))
    fused_down = run_converter(down, grouped(down))
    want_gate_up = torch.stack([torch.cat([x.w1.weight, x.w3.weight]) for x in ref])
    want_down = torch.stack([x.w2.weight for x in ref])
    assert fused_gate_up.dtype == fused_down.dtype == torch.bfloat16
    assert torch.equal(fused_gate_up.float(), want_gate_up)
    assert torch.equal(fused_down.float(), want_down)

    # The same chain minus the decode for plain (already decoded) per-expert weights.
    plain_gate_up, plain_down = kimi_k3_converters(packed=False)
    by_pattern = {p: [] for p in plain_gate_up.source_patterns}
    for e, x in enumerate(ref):
        for proj in ("w1", "w3"):
            _, pattern = plain_gate_up.rename_source_key(f"{module}.{e}.{proj}.weight")
            by_pattern[pattern].append(getattr(x, proj).weight)
    assert torch.equal(run_converter(plain_gate_up, by_pattern), want_gate_up)
    (pattern,) = plain_down.source_patterns
    assert torch.equal(run_converter(plain_down, {pattern: [x.w2.weight for x in ref]}), want_down)


# ------------------------------------------------------------------------------------------------
# Missing / mismatched tensors
# ------------------------------------------------------------------------------------------------


def _no_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any tensor bytes are read (the source check works from headers alone)."""

    def no_reads(self, key, *args):
        raise AssertionError(f"read {key} before refusing the checkpoint")

    monkeypatch.setattr(CheckpointReader, "get", no_reads)
    monkeypatch.setattr(CheckpointReader, "get_rows", no_reads)


def test_missing_expert_key_is_refused(copy_ckpt, monkeypatch: pytest.MonkeyPatch) -> None:
    key = f"{LAYERS}.2.block_sparse_moe.experts.5.w3.weight_packed"
    path = copy_ckpt(drop=[key])
    assert key not in json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    other = f"{LAYERS}.1.block_sparse_moe.experts.0.w2.weight_scale"
    path2 = copy_ckpt(drop=[other])
    _no_reads(monkeypatch)
    model = None
    with pytest.raises(SourceMismatchError) as err:
        model = _load(path, dtype=torch.float32)
    assert model is None
    assert f"1 missing: {key}" in str(err.value)
    # Every expert of the layer: a missing projection in any slot names that slot.
    with pytest.raises(SourceMismatchError, match=re.escape(other)):
        _load(path2, dtype=torch.float32)


def test_missing_dense_key_is_refused(copy_ckpt, monkeypatch: pytest.MonkeyPatch) -> None:
    key = f"{LAYERS}.1.block_sparse_moe.shared_experts.up_proj.weight"
    path = copy_ckpt(drop=[key])
    _no_reads(monkeypatch)
    with pytest.raises(SourceMismatchError, match=rf"model built from config.json: 1 missing: {re.escape(key)}"):
        _load(path, dtype=torch.float32)


def test_index_naming_absent_tensor_is_refused(copy_ckpt) -> None:
    key = f"{LAYERS}.1.block_sparse_moe.experts.0.w1.weight_scale"
    with pytest.raises(CheckpointError, match=re.escape(key)):
        _load(copy_ckpt(drop=[key], drop_from_index=False), dtype=torch.float32)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda t: t.view(torch.int8), id="dtype"),
        pytest.param(lambda t: t[:, :-1], id="shape"),
        pytest.param(lambda t: t.to(torch.bfloat16), id="unpacked-dtype"),
    ],
)
def test_packed_expert_with_wrong_dtype_or_shape_is_refused(
    copy_ckpt, tiny_ckpt: Path, change, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = f"{LAYERS}.3.block_sparse_moe.experts.7.w2.weight_packed"
    original = read_checkpoint(tiny_ckpt)[key]
    bad = change(original)
    path = copy_ckpt(replace={key: bad})
    cfg = _text_config(tiny_ckpt)
    _no_reads(monkeypatch)
    with pytest.raises(SourceMismatchError) as err:
        _load(path, dtype=torch.float32)
    msg = str(err.value)
    want = [cfg["routed_expert_hidden_size"], cfg["moe_intermediate_size"] // 2]
    assert key in msg and str(bad.dtype) in msg and f"torch.uint8 {want}" in msg, msg


# ------------------------------------------------------------------------------------------------
# Dense tensors pass through unchanged
# ------------------------------------------------------------------------------------------------


def test_dense_moe_tensors_load_byte_equal(loaded_bf16, tiny_ckpt: Path) -> None:
    model, _ = loaded_bf16
    tensors = read_checkpoint(tiny_ckpt)
    params = dict(model.named_parameters())
    wanted = re.compile(
        r"(\.shared_experts\.|\.routed_expert_(down_proj|up_proj|norm)\.|\.block_sparse_moe\.gate\.|_res_proj\.)"
    )
    checked = {k for k in tensors if wanted.search(k)}
    assert any(".shared_experts." in k for k in checked)
    assert any(".routed_expert_norm." in k for k in checked)
    assert any("output_attn_res_proj" in k for k in checked)
    assert any(".gate.e_score_correction_bias" in k for k in checked)
    for key in sorted(checked):
        src, got = tensors[key], params[key].detach()
        assert model.modelopt_k3.source_dtypes[key] == src.dtype, key
        if src.dtype == got.dtype:
            assert got.shape == src.shape and got.view(torch.uint8).equal(src.view(torch.uint8)), key
        else:
            # F32 in the checkpoint (the router's correction bias) into a parameter the remote code
            # creates in the default dtype: the same cast from_pretrained(dtype=bf16) does.
            assert src.dtype == torch.float32 and got.dtype == torch.bfloat16, key
            assert torch.equal(got, src.to(got.dtype)), key
    assert all(params[k].dtype == torch.bfloat16 for k in checked if tensors[k].dtype == torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# What the real remote code needs: buffers built, not read; A_log's stored layout
# ------------------------------------------------------------------------------------------------

TIME_WEIGHT = "vision_tower.patch_embed.pos_emb.time_weight"


def test_non_persistent_buffers_are_built_not_read(loaded_bf16, tiny_ckpt: Path, tiny_reference) -> None:
    model, reads = loaded_bf16
    info = model.modelopt_k3
    assert TIME_WEIGHT not in read_checkpoint(tiny_ckpt) and TIME_WEIGHT not in info.keys_read
    assert TIME_WEIGHT not in {k for k, _ in reads}
    # What the module's own __init__ computes (the reference builds for real), cast with the tower to bf16.
    want = tiny_reference.get_buffer(TIME_WEIGHT)
    got = model.get_buffer(TIME_WEIGHT)
    assert got.dtype == torch.bfloat16 and want.abs().sum() > 0
    assert torch.equal(got, want.to(torch.bfloat16))


def test_materialize_keeps_buffers_built_for_real() -> None:
    from accelerate import init_empty_weights

    from modelopt_k3.load import materialize, persistent_tensors

    class Module(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)
            self.register_buffer("table", torch.arange(4.0), persistent=False)
            self.register_buffer("kept", torch.ones(2))

    with init_empty_weights(include_buffers=False):
        m = Module()
    assert m.lin.weight.is_meta and not m.table.is_meta
    materialize(m, "cpu")
    assert not m.lin.weight.is_meta and torch.equal(m.table, torch.arange(4.0)) and torch.equal(m.kept, torch.ones(2))
    assert set(persistent_tensors(m)) == {"lin.weight", "lin.bias", "kept"}


def test_a_log_loads_from_the_zero_padded_layout(loaded_f32: torch.nn.Module, tiny_ckpt: Path) -> None:
    tensors = read_checkpoint(tiny_ckpt)
    a_logs = {n: p for n, p in loaded_f32.named_parameters() if n.endswith(".A_log")}
    assert a_logs
    for name, param in a_logs.items():
        stored, heads = tensors[name], param.shape[0]
        assert stored.dtype == param.dtype == torch.float32
        assert stored.shape[0] > heads and torch.equal(param.detach(), stored[:heads]), name
        assert loaded_f32.modelopt_k3.source_dtypes[name] == torch.float32


@pytest.mark.parametrize("change", ["nonzero-tail", "too-short"])
def test_a_log_layout_is_checked(copy_ckpt, tiny_ckpt: Path, change: str) -> None:
    key = f"{LAYERS}.1.self_attn.A_log"
    stored = read_checkpoint(tiny_ckpt)[key]
    if change == "nonzero-tail":
        bad, match = stored.clone(), f"{key}: .* entry {stored.shape[0] - 1} is 0.5"
        bad[-1] = 0.5
    else:
        bad, match = stored[:1].clone(), rf"{key}: checkpoint shape \[1\] cannot hold"
    with pytest.raises(LoadError, match=re.escape(key)) as err:
        _load(copy_ckpt(replace={key: bad}))
    assert re.search(match, str(err.value)), err.value


# ------------------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------------------


def test_refuses_without_trust_remote_code(tiny_ckpt: Path) -> None:
    with pytest.raises(SpecError, match=r"trust_remote_code=True") as err:
        load_pretrained(tiny_ckpt, progress=False)
    assert "--trust_remote_code" in str(err.value)
    assert "modeling_kimi_k3.KimiK3ForConditionalGeneration" in str(err.value)


def test_prepare_refuses_remote_code_without_moe_block(copy_ckpt, tiny_ckpt: Path) -> None:
    renamed = copy_ckpt(
        name="ckpt_no_moe_block",
        edit_files={"modeling_kimi_linear.py": lambda s: s.replace(BLOCK_CLASS, "SomeOtherMoeBlock")},
    )
    with pytest.raises(SpecError, match=rf"defines {BLOCK_CLASS}"):
        _load(renamed, dtype=torch.float32)
    # A model class from a module tree without the block (not a Kimi checkpoint at all).
    model_cls, config = _remote(tiny_ckpt)
    with pytest.raises(SpecError, match=rf"defines {BLOCK_CLASS}"):
        KIMI_K3_SPEC.loading.prepare(PrepareContext(torch.nn.Linear, config, tiny_ckpt))


def test_prepare_refuses_without_checkpoint_path(tiny_ckpt: Path) -> None:
    model_cls, config = _remote(tiny_ckpt)
    before = getattr(find_block_module(model_cls), BLOCK_CLASS)
    with pytest.raises(SpecError, match="checkpoint path"):
        KIMI_K3_SPEC.loading.prepare(PrepareContext(model_cls, config, None))
    assert getattr(find_block_module(model_cls), BLOCK_CLASS) is before  # nothing patched


def _set_format(where: str, value):
    def edit(config: dict) -> None:
        q = config["text_config"]["quantization_config"]
        if where == "top":
            q["format"] = value
        elif where == "group":
            q["config_groups"]["group_0"]["format"] = value
        elif where == "both":
            q["format"] = q["config_groups"]["group_0"]["format"] = value
        elif where == "num_bits":
            q["config_groups"]["group_0"]["weights"]["num_bits"] = value
        elif where == "quant_method":
            q["quant_method"] = value

    return edit


@pytest.mark.parametrize(
    ("where", "value", "cause"),
    [
        ("top", "bogus-format", "bogus-format"),
        ("group", "bogus-format", "bogus-format"),
        ("both", "nvfp4-pack-quantized", "nvfp4-pack-quantized"),
        ("num_bits", "four", "num_bits"),
        ("quant_method", "bogus-method", "bogus-method"),
    ],
)
def test_refuses_unparsable_or_unsupported_scheme(copy_ckpt, where: str, value, cause: str) -> None:
    path = copy_ckpt(edit_config=_set_format(where, value))
    with pytest.raises(SpecError, match="quantization_config") as err:
        _load(path, dtype=torch.float32)
    assert cause in str(err.value)


def test_refuses_old_transformers(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # By dotted name: importing some transformers submodules replaces sys.modules["transformers"] with a
    # fresh lazy module, and check_transformers reads whichever is current.
    monkeypatch.setattr("transformers.__version__", "4.0.0")
    with pytest.raises(SpecError) as err:
        _load(tiny_ckpt)
    msg = str(err.value)
    assert KIMI_K3_SPEC.min_transformers in msg and "4.0.0" in msg and "kimi_k3" in msg, msg


def test_refuses_unknown_plan(tiny_ckpt: Path) -> None:
    with pytest.raises(PlanError, match=r"unknown plan 'tensor_parallel'.*expert_parallel"):
        _load(tiny_ckpt, plan="tensor_parallel")


def test_refuses_fsdp2_in_one_process(tiny_ckpt: Path) -> None:
    with pytest.raises(PlanError, match=r"'fsdp2' shards over the ranks.*WORLD_SIZE=1; use 'whole'"):
        _load(tiny_ckpt, plan="fsdp2")


def test_refuses_indivisible_ep_degree_directly() -> None:
    with pytest.raises(PlanError, match=r"num_experts=8 is not divisible by the expert-parallel degree 3"):
        decide_plan(
            "expert_parallel", spec=KIMI_K3_SPEC, num_experts=8, rank=0, world_size=3,
            device=torch.device("cpu"), ep_degree=3,
        )  # fmt: skip
    plan = decide_plan(
        "expert_parallel", spec=KIMI_K3_SPEC, num_experts=8, rank=1, world_size=2,
        device=torch.device("cpu"), ep_degree=2,
    )  # fmt: skip
    assert plan.expert_placement == ExpertPlacement(8, ep_size=2, ep_rank=1, writes_experts=True)
    assert plan.experts_implementation == "torch_a2a"


def test_refuses_indivisible_ep_degree_before_reading(
    tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = RunGroup(rank=0, world_size=3, local_rank=0, backend="gloo", device=torch.device("cpu"))
    monkeypatch.setattr("modelopt_k3.load.pretrained.current_group", lambda: fake)
    # No process group behind the fake one: its steps run locally (as at world size 1).
    monkeypatch.setattr("modelopt_k3.load.pretrained.run_together", lambda step, fn, *a, group=None, **kw: fn(*a, **kw))
    monkeypatch.delenv("MODELOPT_K3_EP_DEGREE", raising=False)

    def no_reads(self, key):
        raise AssertionError(f"read {key} before refusing the plan")

    monkeypatch.setattr(CheckpointReader, "get", no_reads)
    model_cls, _ = _remote(tiny_ckpt)
    before = getattr(find_block_module(model_cls), BLOCK_CLASS)
    with pytest.raises(PlanError, match=r"num_experts=8 is not divisible by the expert-parallel degree 3"):
        _load(tiny_ckpt, plan="expert_parallel")
    assert getattr(find_block_module(model_cls), BLOCK_CLASS) is before


# ------------------------------------------------------------------------------------------------
# prepare: idempotent, and blocks built before keep their forward
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_prepare_is_idempotent_and_spares_existing_blocks(tiny_ckpt: Path, input_ids: torch.Tensor) -> None:
    from modelopt_k3.testing.reference import load_reference_model

    model_cls, config = _remote(tiny_ckpt)
    unprepare(model_cls)
    module = find_block_module(model_cls)
    original = getattr(module, BLOCK_CLASS)
    ref = load_reference_model(tiny_ckpt)
    before = reference_logits(ref, input_ids)

    ctx = PrepareContext(model_cls, config, tiny_ckpt)
    KIMI_K3_SPEC.loading.prepare(ctx)
    patched = getattr(module, BLOCK_CLASS)
    assert patched is not original and issubclass(patched, original)
    KIMI_K3_SPEC.loading.prepare(ctx)
    assert getattr(module, BLOCK_CLASS) is patched  # same class object, not a re-wrap
    KIMI_K3_SPEC.loading.prepare(PrepareContext(model_cls, config, tiny_ckpt))
    assert getattr(module, BLOCK_CLASS) is patched
    assert patched._modelopt_k3_original is original

    for name, block in _moe_blocks(ref).items():
        assert type(block) is original, name
        assert isinstance(block.experts, torch.nn.ModuleList), name
    assert torch.equal(reference_logits(ref, input_ids), before)

    # A model built now gets fused experts.
    with torch.device("meta"):
        fresh = model_cls(config)
    assert all(isinstance(b.experts, KimiK3Experts) for b in _moe_blocks(fresh).values())

    unprepare(model_cls)
    assert getattr(module, BLOCK_CLASS) is original
    unprepare(model_cls)  # idempotent too
    assert getattr(module, BLOCK_CLASS) is original


# ------------------------------------------------------------------------------------------------
# What was read
# ------------------------------------------------------------------------------------------------


def test_each_tensor_read_once(loaded_bf16, loaded_f32: torch.nn.Module, tiny_ckpt: Path) -> None:
    model, reads = loaded_bf16
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    all_keys = set(index["weight_map"])
    total = index["metadata"]["total_size"]
    for m in (model, loaded_f32):
        info = m.modelopt_k3
        assert len(info.keys_read) == len(set(info.keys_read))
        assert set(info.keys_read) == all_keys
        assert info.bytes_read == total
    # Across every reader the load opened (prepare's included), in this process.
    keys = [k for k, _ in reads]
    assert len(keys) == len(set(keys)) and set(keys) == all_keys
    assert sum(n for _, n in reads) == total


def test_building_a_fused_block_builds_one_expert_module_not_one_per_expert(
    tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building on meta: the remote per-expert list (replaced by the fused experts) costs one expert module
    per block, not ``num_experts``; the remote module's expert class is put back afterwards."""
    model_cls, config = _remote(tiny_ckpt)
    KIMI_K3_SPEC.loading.prepare(PrepareContext(model_cls, config, tiny_ckpt))
    module = find_block_module(model_cls)
    expert_cls = module.KimiBlockSparseMLP
    built: list[object] = []
    real_init = expert_cls.__init__

    def counting_init(self, *args, **kwargs):
        built.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(expert_cls, "__init__", counting_init)
    with torch.device("meta"):
        model = model_cls(config)
    blocks = _moe_blocks(model)
    assert blocks and all(isinstance(b.experts, KimiK3Experts) for b in blocks.values())
    assert len(built) == len(blocks)  # one per block; the tiny config has 8 experts per block
    assert module.KimiBlockSparseMLP is expert_cls


def test_an_error_while_decoding_experts_in_a_worker_is_raised_by_the_load(
    tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expert tensors are read and decoded by the numerics workers; a read failing there fails the load."""
    bad = f"{LAYERS}.2.block_sparse_moe.experts.5.w3.weight_packed"
    real_get = CheckpointReader.get

    def get(self, key):
        if key == bad:
            raise CheckpointError(f"{key}: read failed (injected)")
        return real_get(self, key)

    monkeypatch.setattr(CheckpointReader, "get", get)
    with pytest.raises(CheckpointError, match="read failed"):
        _load(tiny_ckpt)
