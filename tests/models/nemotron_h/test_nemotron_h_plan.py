"""The planner on a full-size Nemotron-3 Super layout (header-only, ``testing/header_only_nemotron_h.py``): the
layout holds the release's 42,683 tensors (the count a public requantization of the BF16 release reports), and
the answer to "what fits on 8 x 141 GiB" is expert parallelism (its BF16 weights, 230 GiB, fit no single GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

GIB = 2**30


@pytest.mark.slow
def test_full_size_super_layout_and_what_fits_on_8_x_141_gib(tmp_path: Path):
    from modelopt_k3.memory.inventory import read_layout
    from modelopt_k3.memory.planner import Asked, RunShape, estimate_asked
    from modelopt_k3.testing.header_only_nemotron_h import make_nemotron_3_super_layout

    path = make_nemotron_3_super_layout(tmp_path / "super")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == 42683
    layout = read_layout(path)
    assert layout.num_experts == 512
    shape = RunShape(batch_size=1, calib_seq=2048, recipe="models/nvidia/Nemotron-3/nvfp4_experts")
    whole = estimate_asked(layout, Asked("whole", "replicated", "bf16", 1), shape)
    ep8 = estimate_asked(layout, Asked("expert_parallel", "replicated", "bf16", 8), shape)
    assert whole.resident > 141 * GIB and whole.peak > 141 * GIB
    assert ep8.refused is None and ep8.peak < 141 * GIB, ep8.stages
    # Expert parallelism shards the routed experts only: 8 ranks hold the dense part each and 1/8 of the experts.
    assert ep8.resident_experts * 8 == pytest.approx(whole.resident_experts, rel=1e-3)
