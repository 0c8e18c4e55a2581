"""Packed-resident experts (experts/packed.py) in one process: bit-identical to the bf16 residency
under every experts implementation, whole-layer and chunked decode, calibration, fake quant and export;
amax from the packed blocks; refusals."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from dist.test_expert_parallel import assert_exports_equal

from modelopt_k3 import export_checkpoint, load_pretrained, quantize
from modelopt_k3.dist.fsdp import full_amax
from modelopt_k3.dist.plan import PlanError, decide_plan
from modelopt_k3.experts.packed import (
    DecodeWorkspace,
    ResidencyError,
    is_packed,
    packed_param_bytes,
    packed_weight_amax,
    to_packed,
)
from modelopt_k3.models.kimi_k3 import KIMI_K3_SPEC, KimiK3Experts
from modelopt_k3.numerics import mxfp4_decode

pytestmark = [pytest.mark.usefixtures("restore_remote_code"), pytest.mark.slow]  # whole models under every experts implementation
IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def _experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return KIMI_K3_SPEC.experts_modules(model)


def _set_impl(model: torch.nn.Module, impl: str) -> None:
    model.config.text_config._experts_implementation = impl


@pytest.fixture(scope="module")
def models(tiny_ckpt: Path) -> dict[str, torch.nn.Module]:
    return {r: load_pretrained(tiny_ckpt, trust_remote_code=True, experts=r, progress=False) for r in ("bf16", "packed")}


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(7))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_packed_layout_holds_source_bytes(models, tiny_ckpt: Path) -> None:
    from modelopt_k3.checkpoint import CheckpointReader

    bf16, packed = models["bf16"], models["packed"]
    assert packed.modelopt_k3.plan.experts_residency == "packed"
    with CheckpointReader(tiny_ckpt) as reader:
        for name, module in _experts(packed).items():
            assert is_packed(module) and not list(module.parameters(recurse=False))
            assert module.gate_up_proj.is_meta and module.gate_up_proj.shape == _experts(bf16)[name].gate_up_proj.shape
            # Rows are the fused layout: w1 rows then w3 rows, the checkpoint's bytes.
            e = 5
            for proj, rows in (("w1", slice(0, 64)), ("w3", slice(64, 128))):
                got = module.gate_up_proj_qdata[e, rows]
                assert torch.equal(got, reader.get(f"{name}.{e}.{proj}.weight_packed"))
                assert torch.equal(module.gate_up_proj_scale[e, rows], reader.get(f"{name}.{e}.{proj}.weight_scale"))
            assert torch.equal(module.down_proj_qdata[e], reader.get(f"{name}.{e}.w2.weight_packed"))
            # The decoded layer is the bf16 residency's parameter, bit for bit.
            ref = _experts(bf16)[name]
            for p in ("gate_up_proj", "down_proj"):
                lay = module.packed_layouts[p]
                decoded = mxfp4_decode(getattr(module, lay.qdata_name), getattr(module, lay.scale_name))
                assert torch.equal(decoded, getattr(ref, p))
            ratio = packed_param_bytes(module) / sum(p.nbytes for p in ref.parameters(recurse=False))
            assert ratio == pytest.approx(4.25 / 16)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_packed_logits_equal_bf16_whole_and_chunked(models, ids, impl: str) -> None:
    bf16, packed = models["bf16"], models["packed"]
    try:
        _set_impl(bf16, impl)
        want = _logits(bf16, ids)
        for chunk in (None, 3, 1):  # a whole layer, uneven chunks of 8 local experts, one expert at a time
            for module in _experts(packed).values():
                module.decode_chunk = chunk or module.num_experts
            _set_impl(packed, impl)
            assert torch.equal(_logits(packed, ids), want), f"{impl}, decode_chunk={chunk}"
            ws = next(iter(_experts(packed).values())).workspace
            one = next(iter(_experts(packed).values()))
            per_expert = sum(lay.decoded_bytes() for lay in one.packed_layouts.values())
            assert ws.nbytes == per_expert * (chunk or one.num_experts)  # one layer's (or chunk's), shared
            ws.release()
    finally:
        for m in models.values():
            _set_impl(m, "eager")
        for module in _experts(packed).values():
            module.decode_chunk = module.num_experts


def test_packed_quantize_and_export_equal_bf16(tiny_ckpt: Path, ids, tmp_path: Path) -> None:
    """Calibration amax, fake-quant logits (lossless MXFP4 source: cast of the resident bytes) and the
    export are those of the bf16 residency; chunked decode included."""
    out = {}
    for residency, chunk in (("bf16", None), ("packed", 3)):
        model = load_pretrained(tiny_ckpt, trust_remote_code=True, experts=residency, decode_chunk=chunk, progress=False)
        quantize(model, "presets/nvfp4", lambda m: m(input_ids=ids, use_cache=False), verbose=False)
        amax = {n: q.amax.clone() for n, q in model.named_modules() if hasattr(q, "amax")}
        export_checkpoint(model, tmp_path / residency, progress=False)
        out[residency] = (_logits(model, ids), amax)
    assert torch.equal(out["packed"][0], out["bf16"][0])
    assert out["packed"][1].keys() == out["bf16"][1].keys()
    for name, value in out["bf16"][1].items():
        assert torch.equal(out["packed"][1][name].nan_to_num(-1), value.nan_to_num(-1)), name
    assert_exports_equal(tmp_path / "bf16", tmp_path / "packed")


def _bare_packed_experts(num: int, dtype: torch.dtype) -> torch.nn.Module:
    cfg = SimpleNamespace(_experts_implementation="eager")
    with torch.device("meta"):
        module = KimiK3Experts(cfg, num_experts=num, hidden_dim=64, intermediate_dim=32, act_fn=torch.nn.SiLU())
    module.gate_up_proj.data = module.gate_up_proj.data.to(dtype)
    module.down_proj.data = module.down_proj.data.to(dtype)
    to_packed(module, KIMI_K3_SPEC, DecodeWorkspace())
    module.to_empty(device="cpu")
    return module


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_amax_equals_decoded_amax_with_edge_scales(dtype: torch.dtype) -> None:
    module = _bare_packed_experts(4, dtype)
    g = torch.Generator().manual_seed(0)
    for lay in module.packed_layouts.values():
        q, s = getattr(module, lay.qdata_name), getattr(module, lay.scale_name)
        q.copy_(torch.randint(0, 256, q.shape, generator=g, dtype=torch.uint8))
        s.copy_(torch.randint(100, 140, s.shape, generator=g, dtype=torch.uint8))
        s[0, 0, 0] = 255  # E8M0 NaN: the expert's amax is NaN, as decoding gives
        s[1, 0, 0] = 254  # 6 * 2**127 overflows to inf in fp32 and bf16
        s[2] = 0  # 2**-127: fp32/bf16 subnormals, exact
        q[3] = 0x88  # -0 everywhere: amax 0
    for param, lay in module.packed_layouts.items():
        decoded = mxfp4_decode(getattr(module, lay.qdata_name), getattr(module, lay.scale_name), dtype)
        want, got = full_amax(decoded, (1, 2)), packed_weight_amax(module, param)
        assert torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0)), (param, got, want)
        assert got[0].isnan() and got[1].isinf() and got[3] == 0 and 0 < got[2] < 2**-120


def _library_plan(ckpt: Path, experts: str, plan: str = "whole", world_size: int = 1, **kw):
    """The distribution plan ``load_pretrained(ckpt, plan=, experts=)`` loads through (its ``RunPlan``)."""
    from modelopt_k3.run.planning import library_config, plan_library_load

    config = library_config(ckpt, plan=plan, trust_remote_code=True, dtype=torch.bfloat16, ep_degree=None,
                            dense="replicated", experts=experts, allow_nonfinite_passthrough=False)
    return plan_library_load(config, rank=0, world_size=world_size, device=torch.device("cpu"), **kw).distribution


def test_residency_refusals(tiny_ckpt: Path, tmp_path: Path) -> None:
    from modelopt_k3.testing.qwen3_moe import make_tiny_qwen3_moe

    qwen3_moe_ckpt = make_tiny_qwen3_moe(tmp_path / "qwen3", seed=0)  # experts stored decoded
    plan = decide_plan("whole", spec=KIMI_K3_SPEC, num_experts=8, rank=0, world_size=1, device=torch.device("cpu"))
    with pytest.raises(ResidencyError, match="stores them decoded"):
        _library_plan(qwen3_moe_ckpt, "packed")
    with pytest.raises(ResidencyError, match="stores them decoded"):
        plan.with_residency("packed", packed_source=False)
    with pytest.raises(ResidencyError, match="unknown experts residency"):
        _library_plan(tiny_ckpt, "int4")
    fsdp = decide_plan("fsdp2", spec=KIMI_K3_SPEC, num_experts=8, rank=0, world_size=2, device=torch.device("cpu"))
    with pytest.raises(PlanError, match="--dense fsdp2"):
        fsdp.with_residency("packed")
    # auto never picks packed for fsdp2 (nor for a decoded source); a tiny model fits as bf16 anyway.
    assert _library_plan(tiny_ckpt, "auto", plan="fsdp2", world_size=2).experts_residency == "bf16"
    assert _library_plan(tiny_ckpt, "auto").experts_residency == "bf16"
    with pytest.raises(PlanError, match="decode_chunk"):
        plan.with_residency("bf16", decode_chunk=4)


def test_auto_is_packed_when_bf16_does_not_fit(tiny_ckpt: Path, monkeypatch) -> None:
    """load_pretrained(experts="auto") asks the planner: a device between the two peaks gets packed."""
    from modelopt_k3.memory import planner

    layout, shape = planner.read_layout(tiny_ckpt), planner.RunShape(device="cpu", dtype=torch.bfloat16)
    peaks = {r: planner.estimate_asked(layout, planner.Asked("whole", "replicated", r, 1), shape).peak
             for r in ("bf16", "packed")}
    monkeypatch.setattr(planner, "device_budget", lambda *a: (peaks["bf16"] + peaks["packed"]) // 2)
    chosen = _library_plan(tiny_ckpt, "auto")
    assert chosen.experts_residency == "packed" and chosen.decode_chunk is None  # a whole layer fits
