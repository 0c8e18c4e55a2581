"""The calibration-free converter on the models whose default recipe needs calibration (BF16, INT4 or FP8 experts:
NVFP4 W4A4's input scales need activations): no default recipe, named why; with ``--recipe presets/w4a16_nvfp4``
the converter (shard by shard, no model built) writes the model path's weight-only export byte for byte, the
source's own decoding (Kimi-K2.5's INT4 experts, MiniMax-M2's block FP8) included."""

from __future__ import annotations

import pytest
import torch
from _exports import read_export

RECIPE = "presets/w4a16_nvfp4"
# model type -> what its experts are stored as (the reason the default converter recipe is refused)
NEEDS_CALIBRATION = {"glm_moe_dsa": "BF16", "minimax_m2": "FP8", "nemotron_h": "BF16", "kimi_k25": "INT4"}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(NEEDS_CALIBRATION))
def test_the_converter_with_a_weight_only_recipe_equals_the_model_path(model_type, tmp_path):
    import modelopt_k3
    from modelopt_k3.cli import convert
    from modelopt_k3.spec import SpecError, get_spec
    from modelopt_k3.testing import make_tiny

    with pytest.raises(SpecError, match=f"no calibration-free default recipe.*{NEEDS_CALIBRATION[model_type]}"):
        get_spec(model_type).converter_recipe()
    ckpt = make_tiny(model_type, tmp_path / "ckpt")
    model = modelopt_k3.load_pretrained(ckpt, progress=False)
    modelopt_k3.quantize(model, RECIPE, None, verbose=False)
    modelopt_k3.export_checkpoint(model, tmp_path / "model", progress=False)
    del model
    assert convert.main(["--src", str(ckpt), "--dst", str(tmp_path / "conv"), "--recipe", RECIPE]) in (0, None)
    conv, ref = read_export(tmp_path / "conv"), read_export(tmp_path / "model")
    assert set(conv) == set(ref)
    assert any(k.endswith("weight_scale_2") for k in conv)  # something was quantized, not only copied
    assert [k for k in conv if not torch.equal(conv[k].reshape(-1).view(torch.uint8),
                                               ref[k].reshape(-1).view(torch.uint8))] == []
