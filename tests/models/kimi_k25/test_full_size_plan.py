"""The planner on a header-only full-size Kimi-K2.5 (``testing/header_only_kimi_k25.py``): the real checkpoint's
tensor count, and what fits on 8 x 141 GiB (H200): no resident plan (its experts decode to ~1.9 TB of BF16), the
layerwise expert-parallel run with one 2048-token sequence per batch (the default 4 x 2048 batch's every-expert
calibration workspace alone is ~300 GiB per rank)."""

from __future__ import annotations

import json

import pytest
from _full_size import plan_8_h200

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def full_layout(tmp_path_factory):
    from modelopt_k3.testing.header_only_kimi_k25 import make_kimi_k25_layout

    return make_kimi_k25_layout(tmp_path_factory.mktemp("kimi_k25_full") / "ckpt")


def test_the_layout_is_the_released_checkpoints_and_only_layerwise_fits_8_h200(full_layout):
    index = json.loads((full_layout / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(index) == 208550  # moonshotai/Kimi-K2.5's tensor count (decision 0007)
    resident = plan_8_h200(full_layout, "--batch_size", "1", "--calib_seq", "2048")
    assert not any(r["fits"] for r in resident.values())
    assert resident["fsdp2"]["smallest_world"] == 24
    layerwise = plan_8_h200(full_layout, "--layerwise", "--batch_size", "1", "--calib_seq", "2048")
    ep = layerwise["expert_parallel, dense replicated"]
    assert ep["fits"] and 80 < ep["peak_gib"] < 95, ep
    assert not plan_8_h200(full_layout, "--layerwise")["expert_parallel, dense replicated"]["fits"]  # 4 x 2048
