"""The Kimi-K3 expert layout read from config.json (models/kimi_k3/source_layout.py)."""

from __future__ import annotations

import pytest

from modelopt_k3.models.kimi_k3.source_layout import expert_layout
from modelopt_k3.spec import SpecError


def _text(**fields) -> dict:
    base = {"num_experts": 4, "moe_intermediate_size": 64, "hidden_size": 128, "num_hidden_layers": 6}
    return {"text_config": {**base, **fields}}


def test_kimi_expert_layout_follows_the_remote_codes_moe_layer_rule() -> None:
    layouts = expert_layout(_text(first_k_dense_replace=1, moe_layer_freq=2, routed_expert_hidden_size=32))
    assert [lay.module.split(".")[3] for lay in layouts] == ["2", "4"]  # i >= 1 and i % 2 == 0
    assert dict(layouts[0].projections) == {"w1": (64, 32), "w3": (64, 32), "w2": (32, 64)}
    assert [lay.module.split(".")[3] for lay in expert_layout(_text())] == ["0", "1", "2", "3", "4", "5"]
    assert expert_layout(_text())[0].projections["w2"] == (128, 64)  # no latent size: hidden_size
    assert expert_layout(_text(num_experts=None)) == ()
    with pytest.raises(SpecError, match="moe_intermediate_size"):
        expert_layout(_text(moe_intermediate_size=0))


def test_the_first_moe_layer_is_first_k_dense_replace_itself() -> None:
    """``i >= first_k_dense_replace``: with first_k 2 and freq 2, layer 2 is MoE (a strict > would start at 4)."""
    assert [lay.module.split(".")[3] for lay in expert_layout(_text(first_k_dense_replace=2, moe_layer_freq=2))] == [
        "2", "4"]
    assert [lay.module.split(".")[3] for lay in expert_layout(_text(first_k_dense_replace=3))] == ["3", "4", "5"]


def test_dense_layout_fixes_every_dense_shape_of_a_real_checkpoint(tiny_ckpt) -> None:
    """Every dense tensor of the tiny checkpoint (first_k_dense_replace 1: a dense layer-0 MLP) has the shape
    its rule says; without dense layers there is no MLP rule; a field of 0 is refused."""
    import json
    import re

    from modelopt_k3.checkpoint import CheckpointReader
    from modelopt_k3.models.kimi_k3.source_layout import check_config_fields, dense_layout

    config = json.loads((tiny_ckpt / "config.json").read_text())
    rules = [(re.compile(rx), shape) for rx, shape, _ in dense_layout(config)]
    seen_mlp = False
    with CheckpointReader(tiny_ckpt) as reader:
        for key, (_, shape) in reader.inventory().items():
            fixed = [want for rx, want in rules if want is not None and rx.fullmatch(key)]
            seen_mlp |= ".mlp.down_proj." in key and bool(fixed)
            if fixed:
                assert tuple(shape) == fixed[0], key
    assert seen_mlp
    no_dense = {"text_config": {**config["text_config"], "first_k_dense_replace": 0}}
    assert not any("mlp" in rx for rx, _, _ in dense_layout(no_dense))
    with pytest.raises(SpecError, match=r"text_config.hidden_size = 0; a positive integer"):
        check_config_fields({"text_config": {**config["text_config"], "hidden_size": 0}})


@pytest.mark.parametrize("ep_rank", [0, 1, 3])
def test_place_keeps_this_ranks_block_of_experts(ep_rank: int) -> None:
    """``KimiK3Experts.place``: EP rank r of 4 keeps experts [2r, 2r + 2) of 8, their own weights."""
    import torch
    from torch import nn

    from modelopt_k3.dist.placement import ExpertPlacement
    from modelopt_k3.models.kimi_k3.experts import KimiK3Experts

    experts = KimiK3Experts(None, num_experts=8, hidden_dim=4, intermediate_dim=3, act_fn=nn.SiLU())
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.arange(8.0).view(8, 1, 1).expand(8, 6, 4))
        experts.down_proj.copy_(torch.arange(8.0).view(8, 1, 1).expand(8, 4, 3) + 100)
    experts.place(ExpertPlacement(8, ep_size=4, ep_rank=ep_rank))
    assert experts.num_experts == 2 and experts.expert_offset == 2 * ep_rank and experts.num_global_experts == 8
    assert experts.gate_up_proj[:, 0, 0].tolist() == [2.0 * ep_rank, 2.0 * ep_rank + 1]
    assert experts.down_proj[:, 0, 0].tolist() == [100 + 2.0 * ep_rank, 101 + 2.0 * ep_rank]
    with pytest.raises(ValueError, match="needs a module holding all 8 experts"):
        experts.place(ExpertPlacement(8, ep_size=4, ep_rank=0))


def _dense_exactly_as_declared(config: dict, stored: dict[str, tuple[int, ...]]) -> None:
    """Every stored dense key is one ``dense_required`` declares and vice versa; each declared shape holds."""
    import re

    from modelopt_k3.models.kimi_k3.source_layout import dense_layout, dense_required

    dense = {k: shape for k, shape in stored.items() if ".block_sparse_moe.experts." not in k}
    required = dense_required(config)
    assert len(required) == len(set(required))
    assert set(required) == set(dense), (sorted(set(required) - set(dense))[:5], sorted(set(dense) - set(required))[:5])
    rules = [(re.compile(rx), shape) for rx, shape, _ in dense_layout(config) if shape is not None]
    vision = [k for k in dense if k.startswith(("vision_tower.", "mm_projector."))]
    assert vision and all(any(rx.fullmatch(k) for rx, _ in rules) for k in vision)
    for key, shape in dense.items():
        for rx, want in rules:
            if rx.fullmatch(key):
                assert tuple(shape) == want, key
                break


def test_dense_required_is_exactly_the_stand_ins_dense_tensors_vision_tower_included(tiny_ckpt) -> None:
    """The converter's no-model check (``dense_required``/``dense_layout``) declares every dense tensor of the
    tiny checkpoint, the vision tower and projector with their shapes included, and nothing it lacks."""
    import json

    from modelopt_k3.checkpoint import CheckpointReader

    with CheckpointReader(tiny_ckpt) as reader:
        stored = {k: tuple(shape) for k, (_, shape) in reader.inventory().items()}
    _dense_exactly_as_declared(json.loads((tiny_ckpt / "config.json").read_text()), stored)


def test_dense_required_is_exactly_the_full_size_layouts_dense_tensors() -> None:
    """The same for the full-size Kimi-K3 layout (kimi_k3_reference.md sizes: 93 layers, 27 vision blocks),
    built on meta from the stand-in's remote code."""
    from modelopt_k3.testing.header_only import KIMI_K3_SIZES, layout_tensors

    config, tensors, _ = layout_tensors(KIMI_K3_SIZES)
    _dense_exactly_as_declared(config, {key: shape for key, _, shape in tensors})


def test_vision_biases_are_required_only_where_their_flag_is_set() -> None:
    from modelopt_k3.models.kimi_k3.source_layout import _vision_keys
    from modelopt_k3.testing.header_only import KIMI_K3_SIZES, layout_tensors

    config, _, _ = layout_tensors({**KIMI_K3_SIZES, "vt_num_hidden_layers": 1})
    plain = _vision_keys(config)
    assert not any(k.endswith(".bias") for k in plain)
    flagged = _vision_keys({**config, "vision_config": {**config["vision_config"], "attn_bias": True,
                                                         "linear_bias": True, "patch_embed_proj_bias": True}})
    assert sorted(set(flagged) - set(plain)) == [
        "vision_tower.encoder.blocks.0.mlp.fc0.bias", "vision_tower.encoder.blocks.0.mlp.fc1.bias",
        "vision_tower.encoder.blocks.0.wo.bias", "vision_tower.encoder.blocks.0.wqkv.bias",
        "vision_tower.patch_embed.proj.bias"]
    assert flagged["vision_tower.encoder.blocks.0.wqkv.bias"][0] == (3 * KIMI_K3_SIZES["qkv_hidden_size"],)
    with pytest.raises(SpecError, match="vision_config.vt_hidden_size"):
        _vision_keys({**config, "vision_config": {**config["vision_config"], "vt_hidden_size": 0}})
