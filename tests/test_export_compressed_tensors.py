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
