"""The compressed-tensors export, read back by compressed-tensors' own NVFP4 decompressor."""

from __future__ import annotations

import json

import pytest
import torch
from compressed_tensors.compressors import NVFP4PackedCompressor
from compressed_tensors.quantization import QuantizationConfig
from safetensors import safe_open

from modelopt_k3 import export_checkpoint, load_pretrained, quantize
from modelopt_k3.numerics import mxfp4_decode

pytestmark = pytest.mark.slow  # quantize + export of whole models


def _tensors(path, prefix):
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for key, file in index.items():
        if key.startswith(prefix + "."):
            with safe_open(path / file, framework="pt") as f:
                out[key[len(prefix) + 1 :]] = f.get_tensor(key)
    return out


@pytest.fixture(scope="module")
def ct_export(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("ct") / "out"
    model = load_pretrained(tiny_ckpt, trust_remote_code=True, dtype=torch.float32, progress=False)
    quantize(model, "nvfp4_experts_only", lambda m: m(input_ids=torch.arange(64)[None], use_cache=False),
             verbose=False)
    export_checkpoint(model, out, format="compressed-tensors", progress=False)
    return out


def test_config_parses_with_compressed_tensors(ct_export):
    qcfg = json.loads((ct_export / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qcfg)
    assert parsed.format == "nvfp4-pack-quantized" and parsed.quant_method == "compressed-tensors"
    assert not (ct_export / "hf_quant_config.json").exists()
    text = json.loads((ct_export / "config.json").read_text())["text_config"]
    assert "quantization_config" not in text


def test_experts_decompress_to_the_mxfp4_source(ct_export, tiny_ckpt):
    """compressed-tensors' decoder on our expert tensors gives back the MXFP4 source weights exactly."""
    scheme = QuantizationConfig.model_validate(
        json.loads((ct_export / "config.json").read_text())["quantization_config"]
    ).config_groups["group_0"]
    for layer, expert in ((1, 0), (3, 5)):
        g = {}
        for proj in ("w1", "w3", "w2"):
            prefix = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}"
            ours = _tensors(ct_export, prefix)
            assert set(ours) == {"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"}
            assert ours["weight_global_scale"].shape == (1,) and ours["input_global_scale"].shape == (1,)
            g[proj] = (ours["weight_global_scale"], ours["input_global_scale"])
            decoded = NVFP4PackedCompressor.decompress(dict(ours), scheme)["weight"].float()
            src = _tensors(tiny_ckpt, prefix)
            expected = mxfp4_decode(src["weight_packed"], src["weight_scale"], dtype=torch.float32)
            torch.testing.assert_close(decoded, expected, rtol=0, atol=0)
        assert torch.equal(g["w1"][0], g["w3"][0]) and torch.equal(g["w1"][1], g["w3"][1])


def test_mixed_formats_are_refused(tiny_ckpt, tmp_path):
    model = load_pretrained(tiny_ckpt, trust_remote_code=True, progress=False)
    quantize(model, "models/moonshotai/Kimi-K3/nvfp4_experts-fp8_pb_attention", None, verbose=False)
    with pytest.raises(ValueError, match="modelopt"):
        export_checkpoint(model, tmp_path / "x", format="compressed-tensors", progress=False)
    assert not (tmp_path / "x").exists()


def test_shared_input_groups_share_global_scales(tiny_ckpt, tmp_path):
    """Dense NVFP4 in the compressed-tensors layout: the Linears that read one input (KDA q/k/v/f_a/b/g,
    MLA q_a/kv_a/g, gate/up) store one weight_global_scale, the reciprocal of the group's max amax / 2688,
    and compressed-tensors' decoder reads the codes back under it."""
    model = load_pretrained(tiny_ckpt, trust_remote_code=True, dtype=torch.float32, progress=False)
    quantize(model, "presets/w4a16_nvfp4", None, verbose=False)
    out = tmp_path / "ct"
    export_checkpoint(model, out, format="compressed-tensors", progress=False)
    scheme = QuantizationConfig.model_validate(
        json.loads((out / "config.json").read_text())["quantization_config"]).config_groups["group_0"]
    groups = {
        "language_model.model.layers.1.self_attn": ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_proj"),
        "language_model.model.layers.3.self_attn": ("q_a_proj", "kv_a_proj_with_mqa", "g_proj"),
        "language_model.model.layers.0.mlp": ("gate_proj", "up_proj"),
        "language_model.model.layers.2.block_sparse_moe.shared_experts": ("gate_proj", "up_proj"),
    }
    for parent, projs in groups.items():
        members = {p: _tensors(out, f"{parent}.{p}") for p in projs}
        src = {p: _tensors(tiny_ckpt, f"{parent}.{p}")["weight"].float() for p in projs}
        scales = {m["weight_global_scale"].item() for m in members.values()}
        assert len(scales) == 1, parent
        amax = max(w.abs().amax() for w in src.values())
        assert scales.pop() == (1.0 / (amax / 2688.0)).item(), parent
        for p, tensors in members.items():  # decoded under the shared scale: within one E2M1 step of the source
            decoded = NVFP4PackedCompressor.decompress(dict(tensors), scheme)["weight"].float()
            assert (decoded - src[p]).abs().max() <= src[p].abs().max() / 6 * 2, (parent, p)
