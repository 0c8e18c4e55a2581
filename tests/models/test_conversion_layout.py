"""``layout_blocks``: where each source tensor lands in a decoding chain's result, from shapes alone.

The loader decodes every expert straight into its region of the fused parameter by these blocks; they
must say exactly what running the chain's own stack and concatenation ops gives.
"""

from __future__ import annotations

import pytest
import torch
from transformers.core_model_loading import Chunk, Concatenate, MergeModulelist, WeightConverter

from modelopt_k3.models.kimi_k3.converters import Mxfp4Decompress, kimi_k3_converters
from modelopt_k3.spec.conversion import layout_blocks, run_converter_fields


def _check_against_the_chain(conv: WeightConverter, n: int, shapes: dict[str, tuple[int, int]]) -> None:
    """Give every source (codes and scales) its own values; the chain's result read at each block's region
    must be that source, and the blocks must tile the result exactly once."""
    op = Mxfp4Decompress()
    tensors, decoded_shapes, value = {}, {}, 0
    for pattern in conv.source_patterns:
        field = "codes" if pattern.endswith(op.codes_field) else "scales"
        rows, cols = shapes[field]
        tensors[pattern] = []
        for _ in range(n):
            value += 1
            tensors[pattern].append(torch.full((rows, cols), value, dtype=torch.int32))
        if field == "codes":
            decoded_shapes[pattern] = [op.decoded_shape((rows, cols))] * n
    # the chain's result on codes-shaped markers, widened to the decoded width by repeating each column
    fused = run_converter_fields(conv, {p: [t.repeat_interleave(2, dim=-1) for t in ts] for p, ts in tensors.items()})
    want = fused[op.codes_field]
    shape, blocks = layout_blocks(conv, decoded_shapes)
    assert shape == tuple(want.shape)
    covered = torch.zeros(shape, dtype=torch.int32)
    for b in blocks:
        src = tensors[b.pattern][b.index].repeat_interleave(2, dim=-1)
        assert b.shape == tuple(src.shape)
        assert torch.equal(want[b.where].reshape(b.shape), src), (b.pattern, b.index)
        covered[b.where] += 1
    assert bool((covered == 1).all())
    assert {(b.pattern, b.index) for b in blocks} == {(p, i) for p in decoded_shapes for i in range(n)}


@pytest.mark.parametrize("which", ["gate_up", "down"])
def test_blocks_of_the_kimi_k3_chains_match_the_chain(which: str) -> None:
    gate_up, down = kimi_k3_converters(packed=True)
    _check_against_the_chain(gate_up if which == "gate_up" else down, 3, {"codes": (4, 8), "scales": (4, 1)})


@pytest.mark.parametrize(("stack_dim", "cat_dim"), [(0, 1), (1, 0), (0, -1), (-1, 0), (0, 2)])
def test_blocks_follow_other_stack_and_concatenation_dims(stack_dim: int, cat_dim: int) -> None:
    patterns = [r"a\.weight_packed", r"a\.weight_scale", r"b\.weight_packed", r"b\.weight_scale"]
    conv = WeightConverter(source_patterns=patterns, target_patterns="fused",
                           operations=[Mxfp4Decompress(), MergeModulelist(dim=stack_dim), Concatenate(dim=cat_dim)])
    _check_against_the_chain(conv, 2, {"codes": (3, 4), "scales": (3, 1)})


def test_a_chain_with_another_layout_step_is_refused() -> None:
    conv = WeightConverter(source_patterns=[r"a\.weight_packed", r"a\.weight_scale"], target_patterns="fused",
                           operations=[Mxfp4Decompress(), Chunk(dim=0)])
    with pytest.raises(ValueError, match="only by stacking and concatenation"):
        layout_blocks(conv, {r"a\.weight_packed": [(2, 4)]})


def test_sources_of_unequal_shapes_are_refused() -> None:
    (down,) = kimi_k3_converters(packed=True)[1:]
    (pattern,) = [p for p in down.source_patterns if p.endswith("weight_packed")]
    with pytest.raises(ValueError, match="cannot stack"):
        layout_blocks(down, {pattern: [(2, 4), (3, 4)]})
