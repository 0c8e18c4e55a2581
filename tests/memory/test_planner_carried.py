"""The planner counts what the load holds: modules the checkpoint stores but no model builds (``SourceCheckSpec.
carried``: MTP layers) are read and copied by the export, never resident. A DeepSeek-V3 stand-in with one MTP
layer (its own routed experts, block-FP8 as the decoder's) plans the bytes its load materialises."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelopt_k3.checkpoint import CheckpointReader
from modelopt_k3.memory.inventory import read_layout
from modelopt_k3.memory.planner import Asked, RunShape, estimate_asked, planned


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory) -> Path:
    from modelopt_k3.testing.deepseek_v3 import make_tiny_deepseek_v3

    return make_tiny_deepseek_v3(tmp_path_factory.mktemp("dsv3") / "mtp", num_nextn_predict_layers=1)


def _loaded_bytes(model: torch.nn.Module, experts: dict[str, torch.nn.Module]) -> tuple[int, int]:
    """(dense, routed experts) bytes of the model's parameters and persistent buffers."""
    state = model.state_dict()
    expert = sum(t.nbytes for name, t in state.items() if any(name.startswith(f"{e}.") for e in experts))
    return sum(t.nbytes for t in state.values()) - expert, expert


def test_mtp_layer_is_carried_not_resident(mtp_ckpt: Path) -> None:
    from modelopt_k3 import load_pretrained
    from modelopt_k3.models.deepseek_v3 import DEEPSEEK_V3_SPEC

    layout = read_layout(mtp_ckpt)
    mtp = "model.layers.3."  # num_hidden_layers 3: the MTP layer is the fourth, which transformers does not build
    assert not any(g.module.startswith(mtp) for g in layout.experts)
    assert not any(t.name.startswith(mtp) for t in layout.dense)
    with CheckpointReader(mtp_ckpt) as reader:
        stored = {name: info.nbytes for name, info in reader.headers().items() if name.startswith(mtp)}
    assert stored and {t.name: t.nbytes for t in layout.carried_tensors} == stored

    model = load_pretrained(mtp_ckpt, progress=False, dtype=torch.bfloat16)
    dense, experts = _loaded_bytes(model, DEEPSEEK_V3_SPEC.experts_modules(model))
    est = estimate_asked(layout, Asked("whole", "replicated", "bf16", 1), RunShape(device="cpu"))
    # Experts exactly; the dense part within 1% (as for Kimi-K3: the planner counts the routers in the load
    # dtype, the model keeps them fp32, and the FP8 block scales it counts are consumed by the decode). The MTP
    # layer's dense part alone (its embedding and head) is over 10% of it.
    assert est.resident_experts == experts
    assert est.resident_dense == pytest.approx(dense, rel=0.01)
    # Layerwise: the largest decoder layer is a built one (the MTP layer, as large, is not resident).
    lw = estimate_asked(layout, Asked("whole", "replicated", "bf16", 1), RunShape(device="cpu", layerwise=True))
    assert not lw.largest_module[0].startswith("model.layers.3 ")


@pytest.mark.parametrize("source", ["block_fp8", "int4"])
def test_the_carried_bytes_are_read_and_written_as_the_export_writes_them(source: str, tmp_path: Path) -> None:
    """The wall-time model reads the carried tensors as stored and writes what the export writes for them (a
    block-FP8 or INT4 weight decoded BF16, the rest as stored): equal to a real export's MTP bytes."""
    import modelopt_k3
    from modelopt_k3.memory.wall_time import carried_output_bytes, workload_of
    from modelopt_k3.recipe import load_recipe
    from modelopt_k3.testing.deepseek_v3 import make_tiny_deepseek_v3

    ckpt = make_tiny_deepseek_v3(tmp_path / "src", source=source, num_nextn_predict_layers=1)
    recipe = "models/deepseek-ai/DeepSeek-V3/w4a16_nvfp4"
    model = modelopt_k3.load_pretrained(ckpt, progress=False)
    modelopt_k3.quantize(model, recipe, None, verbose=False)
    out = modelopt_k3.export_checkpoint(model, tmp_path / "out", progress=False)
    with CheckpointReader(out) as reader:
        written = sum(info.nbytes for name, info in reader.headers().items() if name.startswith("model.layers.3."))
    layout = read_layout(ckpt)
    assert written and carried_output_bytes(layout, 2) == written

    plan = planned(layout, Asked("whole", "replicated", "bf16", 1), RunShape(device="cpu"))
    work = workload_of(layout, plan, recipe=load_recipe(recipe), calib_size=1, batch_size=1, calib_seq=8,
                       layerwise=False)
    with CheckpointReader(ckpt) as reader:
        stored = sum(info.nbytes for info in reader.headers().values())
    assert work.read_bytes == stored  # every stored byte read once, the carried ones by the export
