"""The Kimi-K3 expert layout read from config.json (models/kimi_k3/layout.py)."""

from __future__ import annotations

import pytest

from modelopt_k3.models.kimi_k3.layout import expert_layout
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
