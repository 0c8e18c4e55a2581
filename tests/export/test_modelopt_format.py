"""The ModelOpt format module: declared layouts match the tensors written; config builders."""

from __future__ import annotations

import fnmatch

import pytest
import torch

from modelopt_k3.export.modelopt_format import (
    config_quantization_config,
    hf_quant_config,
    summarize_exclusions,
)
from modelopt_k3.quant.schemes import KV_FP8, NVFP4_TENSOR, TENSOR_FORMATS, tensor_format


@pytest.mark.parametrize("fmt", list(TENSOR_FORMATS.values()), ids=list(TENSOR_FORMATS))
@pytest.mark.parametrize("shape", [(64, 128), (96, 200 - 200 % 16), (2, 128), (300, 272)])
def test_layout_matches_written_tensors(fmt, shape):
    w = torch.randn(shape).to(torch.bfloat16)
    scale = fmt.scale(w.float().abs().max()) if fmt.per_tensor_scale else None
    written = fmt.weight_tensors(w, scale)
    declared = fmt.weight_layout(shape)
    assert [(k, t.dtype, tuple(t.shape)) for k, t in written.items()] == declared


def test_unknown_format_refused():
    with pytest.raises(ValueError, match="is not one of"):
        tensor_format("int4")


def test_hf_quant_config_single_and_mixed():
    """ModelOpt 0.47's fields and order (get_quant_config / convert_hf_quant_config_format)."""
    single = hf_quant_config({"a.q_proj": "NVFP4", "b.q_proj": "NVFP4"}, kv_cache=KV_FP8,
                             unquantized=["lm_head", "b.k_proj", "c.x.y"], recipe="r")
    assert single["producer"] == {"name": "modelopt", "version": "0.47.0"}
    assert single["modelopt_k3"]["recipe"] == "r"
    q = single["quantization"]
    assert q == {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                 "exclude_modules": ["b.k_proj", "c*", "lm_head"]}
    assert list(q) == ["quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules"]
    cfg = config_quantization_config(single)
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    assert cfg == {
        "config_groups": {"group_0": {"input_activations": fp4, "weights": fp4, "targets": ["Linear"]}},
        "ignore": ["b.k_proj", "c*", "lm_head"], "quant_algo": "NVFP4",
        "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
        "producer": {"name": "modelopt", "version": "0.47.0"}, "quant_method": "modelopt",
    }

    mixed = hf_quant_config({"e.w1": "NVFP4", "a.q_proj": "FP8_PB_WO", "a.k_proj": "FP8_PB_WO"}, kv_cache=None,
                            unquantized=["lm_head"])
    q = mixed["quantization"]
    assert q == {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "group_size": 16, "quantized_layers": {
        "a.k_proj": {"quant_algo": "FP8_PB_WO"}, "a.q_proj": {"quant_algo": "FP8_PB_WO"},
        "e.w1": {"quant_algo": "NVFP4", "group_size": 16}}, "exclude_modules": ["lm_head"]}
    cfg = config_quantization_config(mixed)
    assert cfg["quant_method"] == "modelopt_mixed" and cfg["ignore"] == ["lm_head"] and "kv_cache_scheme" not in cfg
    assert cfg["config_groups"] == {
        "group_0": {"quant_algo": "FP8_PB_WO", "targets": ["a.k_proj", "a.q_proj"]},
        "group_1": {"input_activations": fp4, "weights": fp4, "targets": ["e.w1"]},
    }


def test_nvfp4_weight_scale_2_is_the_given_scalar():
    w = torch.randn(32, 64)
    gs = w.abs().max() / 2688.0
    t = NVFP4_TENSOR.weight_tensors(w, gs)
    assert t["weight_scale_2"].shape == () and t["weight_scale_2"].dtype == torch.float32
    assert torch.equal(t["weight_scale_2"], gs.float())


def test_exclusions_of_a_layer_never_cover_a_quantized_layer_it_is_a_string_prefix_of():
    """``layers.1`` kept BF16 beside a quantized ``layers.10``: its wildcard must be ``layers.1.*``, since
    ``layers.1*`` also matches ``layers.10`` (engines match ``exclude_modules`` with fnmatch); the other way
    round ``layers.10*`` is the shortest wildcard, as nothing quantized starts with ``layers.10``."""
    lm = "language_model.model.layers"
    quantized = [f"{lm}.10.mlp.down_proj", f"{lm}.10.self_attn.q_proj", f"{lm}.2.mlp.up_proj"]
    unquantized = [f"{lm}.1.mlp.down_proj", f"{lm}.1.self_attn.q_proj", f"{lm}.2.mlp.down_proj"]
    got = summarize_exclusions(unquantized, quantized)
    assert got == [f"{lm}.1.*", f"{lm}.2.mlp.down_proj"]
    assert summarize_exclusions(quantized[:2], unquantized[:2]) == [f"{lm}.10*"]
    for name in quantized:
        assert not [p for p in got if fnmatch.fnmatchcase(name, p)], name
    for name in unquantized:
        assert [p for p in got if fnmatch.fnmatchcase(name, p)], name
