"""The planner on a full-size GLM-5 layout without the bytes (``testing/glm_moe_dsa.py``'s ``make_glm5_layout``:
zai-org/GLM-5's config.json sizes, BF16, its MTP layer stored as ``model.layers.78``): what the default
``--qformat nvfp4`` recipe fits on 8 x 141 GiB (H200), resident and layerwise. The MTP layer is carried (read and
copied by the export), never resident. The layout's generator is the stand-in's own, checked at tiny sizes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from _full_size import plan_8_h200, stored_headers

GiB = 2**30


def test_the_layout_at_tiny_sizes_is_the_stand_in(glm_ckpt: Path, tmp_path: Path) -> None:
    """Names, dtypes and shapes, MTP layer included: the full-size layout comes from the stand-in's rules."""
    from modelopt_k3.testing.glm_moe_dsa import GLM_MOE_DSA_TINY_DEFAULTS, make_glm5_layout

    layout = make_glm5_layout(tmp_path / "tiny", sizes=GLM_MOE_DSA_TINY_DEFAULTS)
    assert stored_headers(layout) == stored_headers(glm_ckpt)


@pytest.mark.slow
def test_full_size_glm5_on_8_x_141_gib(tmp_path: Path) -> None:
    """744B parameters built (75 MoE layers x 256 experts; ~1.39 TiB of BF16) and a 10B-parameter MTP layer
    carried. No resident plan fits 8 x 141 GiB (expert parallelism holds ~204 GiB of weights per rank); at the
    default 4 x 2048 tokens per batch not even a layerwise run does (the every-expert calibration workspace is
    ~178 GiB per rank); layerwise expert parallelism at 1 x 2048 does (~52 GiB)."""
    from modelopt_k3.memory.inventory import read_layout
    from modelopt_k3.memory.planner import Asked, RunShape, estimate_asked
    from modelopt_k3.testing.glm_moe_dsa import make_glm5_layout

    path = make_glm5_layout(tmp_path / "GLM-5")
    layout = read_layout(path)
    assert len(layout.experts) == 75 and {g.num_experts for g in layout.experts} == {256}
    built = (sum(math.prod(t.shape) for t in layout.dense)
             + sum(g.num_experts * g.decoded_numel_per_expert for g in layout.experts))
    assert built == pytest.approx(744e9, rel=0.001)
    mtp = "model.layers.78."
    assert layout.carried_tensors and all(t.name.startswith(mtp) for t in layout.carried_tensors)
    assert not any(t.name.startswith(mtp) for t in layout.dense)
    # Resident = the built model's BF16 bytes, the MTP layer's not among them.
    whole = estimate_asked(layout, Asked("whole", "replicated", "bf16", 1), RunShape(batch_size=1))
    assert whole.resident_dense + whole.resident_experts == built * 2

    resident = plan_8_h200(path)
    assert not any(r["fits"] for r in resident.values())
    layerwise = plan_8_h200(path, "--layerwise")
    assert not any(r["fits"] for r in layerwise.values())
    one_seq = plan_8_h200(path, "--layerwise", "--batch_size", "1")
    ep = one_seq["expert_parallel, dense replicated"]
    assert ep["fits"] and 40 < ep["peak_gib"] < 70, ep
    assert not any(r["fits"] for r in plan_8_h200(path, "--batch_size", "1").values())
