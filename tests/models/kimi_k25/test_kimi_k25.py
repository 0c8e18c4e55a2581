"""Kimi-K2.5 through the spec contract: the registry's stand-in loads (INT4 experts decoded as they load) with
transformers' own ``Kimi_K25ForConditionalGeneration``'s text logits, and ``hf_ptq`` exports the hub's names,
the vision tower and projector byte for byte, resident equal to layerwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _exports import read_export
from _standins import dequantized_copy, stored

from modelopt_k3.testing.kimi_k25 import calibration_token_ids

from .conftest import ptq


def _fp32_copy(ckpt: Path, dst: Path) -> Path:
    """The checkpoint with every INT4 expert decoded in fp32 by compressed-tensors' own compressor (its bf16 scale
    given as fp32, so each int4 x scale product is exact), quantization_config dropped at both levels."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import save_file

    config = json.loads((ckpt / "config.json").read_text())
    w = config.pop("quantization_config")["config_groups"]["group_0"]["weights"]
    config["text_config"].pop("quantization_config")
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**{
        k: w[k] for k in ("num_bits", "type", "strategy", "group_size", "symmetric")}))
    tensors, out = stored(ckpt), {}
    for key, t in tensors.items():
        if key.endswith(".weight_packed"):
            head = key.removesuffix(".weight_packed")
            state = {"weight_packed": t, "weight_scale": tensors[f"{head}.weight_scale"].float(),
                     "weight_shape": tensors[f"{head}.weight_shape"]}
            out[f"{head}.weight"] = PackedQuantizationCompressor.decompress(state, scheme)["weight"].float()
        elif not key.endswith((".weight_scale", ".weight_shape")):
            out[key] = t
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _transformers_logits(ckpt: Path, tmp_path: Path, dtype: torch.dtype) -> torch.Tensor:
    """transformers' own Kimi-K2.5 class on the checkpoint, its INT4 experts decoded by compressed-tensors (to bf16
    for a bf16 run, in fp32 for an fp32 one), eager experts as ours build (``grouped_mm`` sums in another order)."""
    from transformers import Kimi_K25ForConditionalGeneration

    source = dequantized_copy(ckpt, tmp_path / "bf16") if dtype == torch.bfloat16 else _fp32_copy(ckpt, tmp_path / "f32")
    ref = Kimi_K25ForConditionalGeneration.from_pretrained(str(source), dtype=dtype, experts_implementation="eager")
    with torch.no_grad():
        return ref(input_ids=calibration_token_ids()).logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float32, marks=pytest.mark.slow)])
def test_logits_equal_transformers_kimi_k25(kimi_k25_ckpt, tmp_path, dtype):
    """Our load of the hub layout (``language_model.*`` as transformers' DeepSeek-V3 classes, INT4 decoded as it
    loads) gives ``Kimi_K25ForConditionalGeneration``'s text logits: bf16 bit for bit, fp32 within 1e-5."""
    import modelopt_k3

    model = modelopt_k3.load_pretrained(kimi_k25_ckpt, dtype=dtype, progress=False)
    assert sorted(model.modelopt_k3.spec.experts_modules(model)) == [
        "language_model.model.layers.1.mlp.experts", "language_model.model.layers.2.mlp.experts"]
    # The vision tower and projector are not built: carried, every stored tensor of theirs.
    assert not any(n.startswith(("vision_tower", "mm_projector")) for n, _ in model.named_parameters())
    assert model.modelopt_k3.carried_keys == {k for k in stored(kimi_k25_ckpt)
                                              if k.startswith(("vision_tower.", "mm_projector."))}
    with torch.no_grad():
        ours = model(input_ids=calibration_token_ids()).logits
    theirs = _transformers_logits(kimi_k25_ckpt, tmp_path, dtype)
    assert ours.dtype == theirs.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(ours, theirs)
    else:
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_hf_ptq_exports_hub_names_and_carries_the_vision_part_byte_for_byte(kimi_k25_ckpt, kimi_k25_export):
    """``--qformat nvfp4``: the routed experts NVFP4 under the hub's ``language_model.model.layers`` names; MLA
    attention, shared experts, the dense layer, routers and lm_head BF16; every vision tower / projector tensor
    the stored bytes (the fused ``wqkv`` included); no INT4 tensor or scheme left."""
    source, ours = stored(kimi_k25_ckpt), read_export(kimi_k25_export)
    vision = [k for k in source if k.startswith(("vision_tower.", "mm_projector."))]
    assert any(k.endswith(".wqkv.weight") for k in vision)
    for key in vision:
        assert ours[key].dtype == source[key].dtype and torch.equal(
            ours[key].reshape(-1).view(torch.uint8), source[key].reshape(-1).view(torch.uint8)), key
    assert not [k for k in ours if k.endswith((".weight_packed", ".weight_shape"))]
    expert = "language_model.model.layers.2.mlp.experts.7.up_proj"
    assert ours[f"{expert}.weight"].dtype == torch.uint8 and f"{expert}.weight_scale_2" in ours
    assert ours["language_model.model.layers.1.self_attn.o_proj.weight"].dtype == torch.bfloat16
    config = json.loads((kimi_k25_export / "config.json").read_text())
    assert "quantization_config" not in config["text_config"]  # the INT4 source scheme is gone from both levels
    excluded = set(json.loads((kimi_k25_export / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"])
    assert {"language_model.lm_head", "language_model.model.layers.0*", "language_model.model.layers.1.mlp.gate",
            "language_model.model.layers.1.self_attn*", "language_model.model.layers.1.mlp.shared_experts*",
            "vision_tower*", "mm_projector*"} <= excluded
    assert config["quantization_config"]["ignore"] == sorted(excluded)


@pytest.mark.slow
def test_layerwise_export_equals_the_resident_export(kimi_k25_ckpt, kimi_k25_export, tmp_path):
    from layerwise.test_layerwise import assert_same_export

    ptq("--pyt_ckpt_path", kimi_k25_ckpt, "--layerwise", "--export_path", tmp_path / "layerwise",
        "--target_engines", "vllm")
    assert_same_export(kimi_k25_export, tmp_path / "layerwise")


def test_carried_vision_tensors_read_the_hubs_vt_spelling(kimi_k25_ckpt):
    """The real config.json spells the tower's sizes ``vt_*`` / ``init_pos_emb_*`` only (transformers 5.25 reads
    neither and silently builds its defaults): the carried layout maps them, so a config spelled as the hub does
    gives the stored tensors, and one whose ``vt_*`` disagree with the shards is refused before any read."""
    from modelopt_k3.checkpoint.source_check import SourceMismatchError, check_carried
    from modelopt_k3.models.kimi_k25.vision import vision_tensors
    from modelopt_k3.spec import get_spec

    config = json.loads((kimi_k25_ckpt / "config.json").read_text())
    hub_only = {**config, "vision_config": {k: v for k, v in config["vision_config"].items() if k not in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "pos_emb_height",
        "pos_emb_width", "pos_emb_time")}}
    source = stored(kimi_k25_ckpt)
    assert vision_tensors(hub_only) == {k: tuple(t.shape) for k, t in source.items()
                                        if k.startswith(("vision_tower.", "mm_projector."))}
    wrong = {**hub_only, "vision_config": {**hub_only["vision_config"], "vt_num_hidden_layers": 3}}
    with pytest.raises(SourceMismatchError, match=r"vision tower.*12 missing: vision_tower\.encoder\.blocks\.2\."):
        check_carried(source, wrong, get_spec("kimi_k25"))
