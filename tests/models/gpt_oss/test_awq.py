"""``awq`` on GPT-OSS, whose routed experts are MXFP4-sourced: their lossless cast is kept, so the MoE input
(post_attention_layernorm -> experts + router) is not smoothed and says why; attention's q/k/v (Linears with a
bias) are smoothed into input_layernorm; the fold leaves the fp32 model's logits unchanged. The experts' up -> down
fold is not made either, and down_proj's label says why."""

from __future__ import annotations

from pathlib import Path

import torch


def test_awq_keeps_the_mxfp4_experts_lossless_cast_and_smooths_attention(tiny_gpt_oss_ckpt: Path) -> None:
    import modelopt_k3
    from modelopt_k3.quant.modules import set_mode

    ids = torch.arange(64).remainder(200).reshape(2, 32)
    source = modelopt_k3.load_pretrained(tiny_gpt_oss_ckpt, progress=False, dtype=torch.float32)
    with torch.no_grad():
        want = source(input_ids=ids).logits
    del source
    model = modelopt_k3.load_pretrained(tiny_gpt_oss_ckpt, progress=False, dtype=torch.float32)

    def loop(m):
        with torch.no_grad():
            m(input_ids=ids)

    modelopt_k3.quantize(model, "models/openai/gpt-oss/nvfp4_awq", loop, verbose=False)
    qplan = model.modelopt_k3_quant
    layers = [n for n, _ in model.model.layers.named_children()]
    smoothed = {i for i in layers if f"model.layers.{i}.input_layernorm.weight" in qplan.rewritten}
    assert smoothed and qplan.rewritten == {f"model.layers.{i}.input_layernorm.weight" for i in smoothed}
    for i in layers:
        assert qplan.weight_algorithms[f"model.layers.{i}.mlp.experts.gate_up_proj"] == "lossless_cast"
        assert "MXFP4-sourced" in qplan.calibration[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        assert "not smoothed by awq: MXFP4-sourced" in qplan.calibration[f"model.layers.{i}.mlp.experts.down_proj"]
        assert qplan.weight_algorithms[f"model.layers.{i}.mlp.experts.down_proj"] == "lossless_cast"
        for p in ("q_proj", "k_proj", "v_proj"):  # smoothed, or the search kept alpha 0 (random weights)
            name = f"model.layers.{i}.self_attn.{p}"
            if i in smoothed:
                assert qplan.weight_algorithms[name] == "awq", name
            else:
                assert qplan.weight_algorithms[name] == "max" and "alpha 0 erred least" in qplan.calibration[name]
    set_mode(model, "off")
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())), float((got - want).abs().max())
