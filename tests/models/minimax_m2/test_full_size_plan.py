"""The planner on a full-size MiniMax-M2 layout without the bytes (``testing/minimax_m2.py``'s
``make_minimax_m2_layout``: MiniMaxAI/MiniMax-M2's config.json sizes, block-FP8 attention and experts): what
the default ``--qformat nvfp4`` recipe fits on 8 x 141 GiB (H200), resident and layerwise. The layout's
generator is the stand-in's own, checked at tiny sizes against the stand-in's headers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _full_size import plan_8_h200, stored_headers


def test_the_layout_at_tiny_sizes_is_the_stand_in(minimax_m2_ckpt: Path, tmp_path: Path) -> None:
    """Names, dtypes and shapes: the full-size layout comes from the rules that write the stand-in."""
    from modelopt_k3.testing.minimax_m2 import MINIMAX_M2_TINY_DEFAULTS, make_minimax_m2_layout

    layout = make_minimax_m2_layout(tmp_path / "tiny", sizes=MINIMAX_M2_TINY_DEFAULTS, sparse=True)
    assert stored_headers(layout) == stored_headers(minimax_m2_ckpt)
    stand_in = json.loads((minimax_m2_ckpt / "config.json").read_text())
    assert json.loads((layout / "config.json").read_text())["quantization_config"] == stand_in["quantization_config"]


@pytest.mark.slow
def test_full_size_minimax_m2_on_8_x_141_gib(tmp_path: Path) -> None:
    """About 229B parameters (the card's 230B), 62 MoE layers x 256 experts, stored block-FP8 and decoded to
    BF16 at load (~426 GiB). At the default 4 x 2048 tokens per batch the every-expert calibration workspace
    (~97 GiB per rank) leaves expert parallelism with a replicated dense part just over 141 GiB (~158): the
    fsdp2 plan or a layerwise run fits; at 1 x 2048 expert parallelism fits resident too (~86 GiB)."""
    from modelopt_k3.memory.inventory import read_layout
    from modelopt_k3.testing.minimax_m2 import make_minimax_m2_layout

    path = make_minimax_m2_layout(tmp_path / "MiniMax-M2")
    layout = read_layout(path)
    assert len(layout.experts) == 62 and {g.num_experts for g in layout.experts} == {256}
    params = (sum(math.prod(t.shape) for t in layout.dense if not t.name.endswith("_scale_inv"))
              + sum(g.num_experts * g.decoded_numel_per_expert for g in layout.experts))
    assert params == pytest.approx(229e9, rel=0.005)

    resident = plan_8_h200(path)
    assert not resident["whole"]["fits"] and not resident["expert_parallel, dense replicated"]["fits"]
    assert 141 < resident["expert_parallel, dense replicated"]["peak_gib"] < 170
    assert resident["fsdp2"]["fits"] and resident["fsdp2"]["smallest_world"] == 8
    layerwise = plan_8_h200(path, "--layerwise")
    assert layerwise["expert_parallel, dense replicated"]["fits"]
    assert layerwise["whole"]["fits"]  # one layer (~7 GiB) and one GPU's calibration workspace
    one_seq = plan_8_h200(path, "--batch_size", "1")
    ep = one_seq["expert_parallel, dense replicated"]
    assert ep["fits"] and 70 < ep["peak_gib"] < 100, ep
