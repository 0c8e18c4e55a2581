"""The outlier-channel stand-in (``make_tiny_qwen3_moe(..., outliers=True)``) and the weight algorithms on it.

On heavy-tailed inputs and weights, as a trained LLM's are: ``nvfp4_mse`` errs no more than max on every NVFP4
weight (strictly less in total on each), and ``nvfp4_gptq`` gives every decoder layer, and layer 1's dense MLP
block, a lower output error than max on HELD-OUT tokens (not the calibration tokens). A random model: this
proves the mechanics generalise off the calibration set, not quality.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from modelopt_k3.numerics import nvfp4_fake_quant
from modelopt_k3.testing.qwen3_moe import (
    OUTLIER_FACTOR,
    calibration_token_ids,
    make_tiny_qwen3_moe,
    outlier_channels,
)

# The default stand-in's shards (seed 0, default sizes), pinned: the outlier option must not move them.
DEFAULT_SHARDS_SHA256 = {
    "model-00001-of-00004.safetensors": "fd1ed73d0000a7c1ac02c2d0d48657af6fcf5462ce107b2fb5c34ba6b09bc440",
    "model-00002-of-00004.safetensors": "98de05505b82d24f91e2009b124cc54b4024c8213b735edffc8816a86d9ed8a1",
    "model-00003-of-00004.safetensors": "e4805cc6ae7bce64148cf539e5272d1715b7ef1421db543d6497b1296cf7835e",
    "model-00004-of-00004.safetensors": "d6c48e99805155f9c6f513a8f406da6975ae2e5c1130f8f892d761ef843bdb40",
}
CALIB = dict(num=16, seq=32)  # 512 calibration tokens
HELD_OUT = dict(num=8, seq=32, seed=4321)  # another seed than calibration_token_ids' 1234


def _tensors(path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})  # noqa: SIM118
    return out


def _kurtosis(t: torch.Tensor) -> float:
    x = t.float().reshape(-1)
    x = x - x.mean()
    return float((x**4).mean() / (x**2).mean() ** 2)


def test_default_stand_in_is_unchanged_and_outliers_are_an_option(qwen3_moe_ckpt, tmp_path):
    shards = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in qwen3_moe_ckpt.glob("*.safetensors")}
    assert shards == DEFAULT_SHARDS_SHA256
    off = make_tiny_qwen3_moe(tmp_path / "off", seed=0, outliers=False)
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in off.glob("*.safetensors")} == shards
    with pytest.raises(TypeError, match="outliers"):
        make_tiny_qwen3_moe(tmp_path / "bad", outliers="yes")


def test_outlier_stand_in_is_deterministic_and_heavy_tailed(qwen3_moe_ckpt, qwen3_moe_outlier_ckpt, tmp_path):
    from modelopt_k3.testing import make_tiny

    again = make_tiny("qwen3_moe", tmp_path / "again", seed=0, outliers=True)  # the spec's stand_in passes it on
    for name in ("config.json", "model.safetensors.index.json", *DEFAULT_SHARDS_SHA256):
        assert (again / name).read_bytes() == (qwen3_moe_outlier_ckpt / name).read_bytes(), name
    assert json.loads((qwen3_moe_outlier_ckpt / "config.json").read_text()) == \
        json.loads((qwen3_moe_ckpt / "config.json").read_text())
    base, out = _tensors(qwen3_moe_ckpt), _tensors(qwen3_moe_outlier_ckpt)
    assert {k: (v.dtype, v.shape) for k, v in base.items()} == {k: (v.dtype, v.shape) for k, v in out.items()}
    channels = outlier_channels(0, 64)
    assert len(channels) == 4 and all(OUTLIER_FACTOR[0] <= f <= OUTLIER_FACTOR[1] for f in channels.values())
    assert outlier_channels(1, 64) != channels  # chosen by seed
    norms = [k for k in base if k.endswith(("input_layernorm.weight", "post_attention_layernorm.weight"))]
    assert len(norms) == 6
    others = torch.tensor([c not in channels for c in range(64)])
    for k in norms:
        assert torch.equal(out[k][others], base[k][others]), k
        want = torch.tensor([float(base[k][c]) * f for c, f in channels.items()])  # to BF16 rounding (2**-8)
        assert torch.allclose(out[k][list(channels)].float(), want, rtol=2**-7, atol=0), k
    for k in ("model.norm.weight", "model.embed_tokens.weight", "model.layers.0.self_attn.q_norm.weight"):
        assert torch.equal(out[k], base[k]), k
    projections = [k for k in base if k.endswith("_proj.weight")]
    assert len(projections) == 15 + 2 * 8 * 3
    # Gaussian weights have kurtosis 3; Student-t(3) with raised rows far above it; every projection changed.
    assert all(_kurtosis(base[k]) < 4 for k in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"))
    assert all(_kurtosis(out[k]) > 8 for k in projections), min((_kurtosis(out[k]), k) for k in projections)
    assert not any(torch.equal(out[k], base[k]) for k in projections)


def _quantized(ckpt, recipe):
    import modelopt_k3

    model = modelopt_k3.load_pretrained(ckpt, progress=False)
    ids = calibration_token_ids(**CALIB)

    def loop(m):
        with torch.no_grad():
            m(input_ids=ids)

    return modelopt_k3.quantize(model, recipe, loop, verbose=False)


@pytest.mark.slow
def test_nvfp4_mse_weight_error_at_most_max_on_the_outlier_stand_in(qwen3_moe_outlier_ckpt):
    from modelopt_k3.quant.calibrators.weights import weight_sites

    model = _quantized(qwen3_moe_outlier_ckpt, "presets/nvfp4_default_mse")
    sites = list(weight_sites(model))
    assert len(sites) == 19  # 15 dense Linears, gate_up/down of the 2 MoE layers' experts
    for site in sites:
        q = site.quantizer
        assert q.block_scale is not None, site.name
        w = getattr(site.module, site.param).detach().float()
        gs = q.scale().view(-1, 1, 1) if site.experts else q.scale()
        per_block = [((nvfp4_fake_quant(w, gs, **kw) - w) ** 2).double().reshape(*w.shape[:-1], -1, 16).sum(-1)
                     for kw in ({"block_scale": q.block_scale}, {})]
        assert bool((per_block[0] <= per_block[1] * (1 + 1e-6)).all()), site.name
        assert per_block[0].sum() < per_block[1].sum(), site.name


def _held_out_layer_calls(model) -> list:
    """Each decoder layer's (args, kwargs) on the held-out tokens, weights unquantized, activations fake-quantized:
    the same inputs for the GPTQ and the max model (their activation scales are equal)."""
    from modelopt_k3.quant.modules import set_mode

    calls: list = []
    hooks = [layer.register_forward_pre_hook(lambda mod, args, kwargs: calls.append((args, dict(kwargs))),
                                             with_kwargs=True) for layer in model.model.layers]
    set_mode(model, "off", role="weight")
    try:
        with torch.no_grad():
            model(input_ids=calibration_token_ids(**HELD_OUT), use_cache=False)
    finally:
        set_mode(model, "quant")
        for h in hooks:
            h.remove()
    return calls


def _block_errors(model, calls: list) -> tuple[list[float], float]:
    """Per decoder layer, and for layer 1's dense MLP block, ``||block_q(x) - block(x)||²`` on the same inputs
    (weights quantized against unquantized; activations fake-quantized in both)."""
    from modelopt_k3.quant.modules import set_mode

    def run(module, *args, **kwargs):
        y = module(*args, **kwargs)
        return (y[0] if isinstance(y, tuple) else y).float()

    def error(module, *args, **kwargs):
        set_mode(model, "off", role="weight")
        try:
            ref = run(module, *args, **kwargs)
        finally:
            set_mode(model, "quant")
        return float(((run(module, *args, **kwargs) - ref) ** 2).double().sum())

    mlp_in: list = []
    hook = model.model.layers[1].mlp.register_forward_pre_hook(lambda mod, args: mlp_in.append(args[0]))
    with torch.no_grad():
        layers = [error(layer, *args, **kwargs) for layer, (args, kwargs) in zip(model.model.layers, calls)]
        hook.remove()
        mlp = error(model.model.layers[1].mlp, mlp_in[0])
    return layers, mlp


@pytest.mark.slow
def test_nvfp4_gptq_beats_max_on_held_out_tokens_on_the_outlier_stand_in(qwen3_moe_outlier_ckpt):
    """The issue's acceptance: every decoder layer's output, and layer 1's dense MLP block output, err less
    under nvfp4_gptq than under max on tokens calibration never saw. One-pass GPTQ (ModelOpt's) and
    sequential GPTQ without the asymmetric target both made the dense MLP block 1.6-1.7x max's (docs/decisions/0029-calibrators.md,
    "Ours, not ModelOpt's"); the asymmetric target brings it to ~0.13x."""
    from modelopt_k3.quant.schemes import NVFP4_TENSOR

    gptq = _quantized(qwen3_moe_outlier_ckpt, "presets/nvfp4_default_gptq")
    mx = _quantized(qwen3_moe_outlier_ckpt, "nvfp4_default")
    linears = {n: m for n, m in gptq.named_modules() if type(m) is torch.nn.Linear
               and getattr(m, "weight_quantizer", None) is not None and m.weight_quantizer.fmt is NVFP4_TENSOR}
    assert len(linears) == 15
    max_modules = dict(mx.named_modules())
    for name, m in linears.items():  # the same activation scales: only the weights differ between the two runs
        assert torch.equal(m.input_quantizer.amax, max_modules[name].input_quantizer.amax), name
        assert m.weight_quantizer.updated_weight is not None, name
        assert gptq.modelopt_k3_quant.calibration[name].startswith("gptq"), name
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"):
        assert gptq.modelopt_k3_quant.weight_algorithms[name] == "gptq", name

    calls = _held_out_layer_calls(mx)
    (layers, mlp), (layers_max, mlp_max) = _block_errors(gptq, calls), _block_errors(mx, calls)
    ratios = [a / b for a, b in zip(layers, layers_max)]
    assert all(r < 1 for r in ratios), ratios
    assert mlp < 0.5 * mlp_max, (mlp, mlp_max)
