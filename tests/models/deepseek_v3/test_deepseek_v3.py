"""DeepSeek-V3 through the spec contract: block-FP8 and INT4 sources decoded as they load, logits equal to
transformers' own model on the dequantized weights, the calibrated NVFP4 export, hf_ptq --qformat nvfp4."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from modelopt_k3.testing.deepseek_v3 import calibration_token_ids

pytestmark = pytest.mark.slow


def _stored(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[key] = f.get_tensor(key)
    return out


def _dequantized_copy(ckpt: Path, dst: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The checkpoint with every block-FP8 weight dequantized by transformers' own declared-block FP8 dequantize
    (``_dequantize_fp8_weight`` in fp32, one cast to BF16) and every INT4 expert by compressed-tensors' own
    ``PackedQuantizationCompressor``, quantization_config removed: what transformers' model is given."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    config = json.loads((ckpt / "config.json").read_text())
    qcfg = config.pop("quantization_config", None) or {}
    stored = _stored(ckpt)
    out: dict[str, torch.Tensor] = {}
    for key, t in stored.items():
        if key.endswith("weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            block = qcfg["weight_block_size"]
            out[key] = _dequantize_fp8_weight(t, stored[key + "_scale_inv"], block, torch.float32).to(dtype)
        elif key.endswith(".weight_packed"):
            head = key.removesuffix(".weight_packed")
            w = qcfg["config_groups"]["group_0"]["weights"]
            scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**{
                k: w[k] for k in ("num_bits", "type", "strategy", "group_size", "symmetric")}))
            state = {n: stored[f"{head}.{n}"] for n in ("weight_packed", "weight_scale", "weight_shape")}
            out[f"{head}.weight"] = PackedQuantizationCompressor.decompress(state, scheme)["weight"].to(dtype)
        elif not key.endswith((".weight_scale", ".weight_shape")):
            out[key] = t
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("source", ["fp8", "int4"])
def test_logits_equal_transformers_on_the_dequantized_weights(source, deepseek_fp8_ckpt, deepseek_int4_ckpt, tmp_path):
    """Our load (sources decoded as they load, experts fused and re-classed on the instance) gives transformers'
    own DeepseekV3ForCausalLM's logits on the references' dequantized weights, bit for bit; transformers'
    experts class itself is left unpatched."""
    from transformers import AutoModelForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    import modelopt_k3

    ckpt = deepseek_fp8_ckpt if source == "fp8" else deepseek_int4_ckpt
    ids = calibration_token_ids()
    model = modelopt_k3.load_pretrained(ckpt, progress=False)
    experts = model.modelopt_k3.spec.experts_modules(model)
    assert len(experts) == 2 and all(isinstance(m, DeepseekV3Experts) for m in experts.values())
    assert not hasattr(DeepseekV3Experts, "down_input_hook")
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    ref = AutoModelForCausalLM.from_pretrained(_dequantized_copy(ckpt, tmp_path / "bf16"), dtype=torch.bfloat16,
                                               experts_implementation="eager")
    assert ref.model.layers[1].mlp.gate.weight.dtype == model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    with torch.no_grad():
        theirs = ref(input_ids=ids).logits
    assert torch.equal(ours, theirs)


def test_an_fp32_load_decodes_every_fp8_weight_exactly(deepseek_fp8_ckpt, tmp_path):
    """``load_pretrained(dtype=float32)`` decodes every block-FP8 weight, dense Linears (attention, dense MLP, shared
    experts) as well as routed experts, as fp8 x scale_inv in fp32 (transformers' ``_dequantize_fp8_weight``), never
    through bf16 (the dense ones were: max |error| 3.9e-3, logits off by up to 3.1), and gives transformers' own
    fp32 model's logits on those weights."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    import modelopt_k3

    model = modelopt_k3.load_pretrained(deepseek_fp8_ckpt, dtype=torch.float32, progress=False)
    block = json.loads((deepseek_fp8_ckpt / "config.json").read_text())["quantization_config"]["weight_block_size"]
    stored, params = _stored(deepseek_fp8_ckpt), dict(model.named_parameters())
    dense = [k for k, t in stored.items() if t.dtype == torch.float8_e4m3fn and ".mlp.experts." not in k]
    assert any("self_attn" in k for k in dense) and any("shared_experts" in k for k in dense)
    for key in dense:
        want = _dequantize_fp8_weight(stored[key], stored[key + "_scale_inv"], block, torch.float32)
        assert params[key].dtype == torch.float32 and torch.equal(params[key], want), key
    layer = model.model.layers[1].mlp.experts
    w1 = _dequantize_fp8_weight(stored["model.layers.1.mlp.experts.3.gate_proj.weight"],
                                stored["model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv"], block, torch.float32)
    assert torch.equal(layer.gate_up_proj[3, : w1.shape[0]], w1)
    ids = calibration_token_ids()
    ref = AutoModelForCausalLM.from_pretrained(_dequantized_copy(deepseek_fp8_ckpt, tmp_path / "fp32", torch.float32),
                                               dtype=torch.float32, experts_implementation="eager")
    with torch.no_grad():
        ours, theirs = model(input_ids=ids).logits, ref(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_fp8_load_reads_no_scale_twice_and_refuses_a_missing_scale(deepseek_fp8_ckpt, tmp_path):
    """Every stored tensor is consumed (scales included, nothing left over); a weight_scale_inv removed from the
    checkpoint is named before any weight is read."""
    import modelopt_k3
    from modelopt_k3.checkpoint.source_check import SourceMismatchError
    from modelopt_k3.load import LoadError

    model = modelopt_k3.load_pretrained(deepseek_fp8_ckpt, progress=False)
    assert set(model.modelopt_k3.keys_read) == set(_stored(deepseek_fp8_ckpt))
    assert model.modelopt_k3.decoded_dense["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv")
    broken = tmp_path / "broken"
    shutil.copytree(deepseek_fp8_ckpt, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    key = "model.layers.0.self_attn.q_b_proj.weight_scale_inv"
    shard = broken / index["weight_map"].pop(key)
    tensors = {k: v for k, v in _stored_file(shard).items() if k != key}
    save_file(tensors, str(shard))
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises((LoadError, SourceMismatchError, ValueError), match="q_b_proj"):
        modelopt_k3.load_pretrained(broken, progress=False)


def _stored_file(shard: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(shard), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def test_nvfp4_export_follows_the_deepseek_recipe(deepseek_fp8_ckpt, deepseek_fp8_export):
    """NVIDIA's DeepSeek-R1 NVFP4 recipe: MLPs (dense, shared, routed) and o_proj NVFP4; the other MLA projections
    and lm_head kept, written dequantized BF16 (the source's FP8 bytes decoded, no weight_scale_inv left), as
    ModelOpt's quantize_to_nvfp4.py writes them; gate/up of each expert share weight_scale_2."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    out, src = _stored(deepseek_fp8_export), _stored(deepseek_fp8_ckpt)
    assert not any(k.endswith("weight_scale_inv") for k in out)
    assert not any(t.dtype == torch.float8_e4m3fn and k.endswith(".weight") for k, t in out.items())
    for layer in range(3):
        attn = f"model.layers.{layer}.self_attn"
        for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
            key = f"{attn}.{proj}.weight"
            want = _dequantize_fp8_weight(src[key], src[key + "_scale_inv"], [128, 128], torch.float32).bfloat16()
            assert out[key].dtype == torch.bfloat16 and torch.equal(out[key], want), key
        assert out[f"{attn}.o_proj.weight"].dtype == torch.uint8 and f"{attn}.o_proj.input_scale" in out
    mlps = ["model.layers.0.mlp", "model.layers.1.mlp.shared_experts"] + [f"model.layers.2.mlp.experts.{e}" for e in range(8)]
    for mlp in mlps:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert out[f"{mlp}.{proj}.weight"].dtype == torch.uint8, mlp
        assert torch.equal(out[f"{mlp}.gate_proj.weight_scale_2"], out[f"{mlp}.up_proj.weight_scale_2"]), mlp
    assert torch.equal(out["lm_head.weight"], src["lm_head.weight"])
    hf_quant = json.loads((deepseek_fp8_export / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["quant_algo"] == "NVFP4"
    assert {"lm_head", "model.layers.1.mlp.gate", "model.layers.0.self_attn.kv_a_proj_with_mqa"} <= set(
        hf_quant["exclude_modules"])
    assert "model.layers.0.self_attn.o_proj" not in hf_quant["exclude_modules"]
    assert "quant_method" not in json.loads((deepseek_fp8_export / "config.json").read_text())["quantization_config"] \
        or json.loads((deepseek_fp8_export / "config.json").read_text())["quantization_config"]["quant_method"] != "fp8"


def test_hf_ptq_qformat_nvfp4_exports(deepseek_fp8_ckpt, tmp_path):
    """examples/hf_ptq.py --pyt_ckpt_path <tiny DeepSeek-V3 FP8> --qformat nvfp4 end to end (no remote code)."""
    import runpy
    import sys

    out = tmp_path / "export"
    argv = ["hf_ptq.py", "--pyt_ckpt_path", str(deepseek_fp8_ckpt), "--qformat", "nvfp4", "--export_path", str(out),
            "--calib_size", "8", "--calib_seq", "32", "--batch_size", "4", "--no_progress", "--report", "none"]
    example = Path(__file__).parents[3] / "examples" / "hf_ptq.py"
    old, sys.argv = sys.argv, argv
    try:
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(example), run_name="__main__")
    finally:
        sys.argv = old
    assert done.value.code in (0, None)
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())
    assert hf_quant["modelopt_k3"]["recipe"] == "models/deepseek-ai/DeepSeek-V3/nvfp4"
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.2.mlp.experts.7.up_proj.weight_scale_2" in weight_map
    assert not any(k.endswith("weight_scale_inv") for k in weight_map)


def test_mla_kv_cache_scale_is_the_latent_and_rope_key_amax(deepseek_fp8_ckpt, tmp_path):
    """kv_cache fp8: one scale per MLA layer = amax over kv_a_layernorm's output and the rope columns of
    kv_a_proj_with_mqa's output, / 448, exported as self_attn.k_proj.k_scale == self_attn.v_proj.v_scale."""
    import modelopt_k3
    from modelopt_k3.recipe import load_recipe

    model = modelopt_k3.load_pretrained(deepseek_fp8_ckpt, progress=False)
    ids = calibration_token_ids()
    seen: dict[str, float] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn

        def keep(mod, args, out, i=i, start=None):
            part = out if start is None else out[..., start:]
            seen[f"{i}"] = max(seen.get(f"{i}", 0.0), part.detach().float().abs().max().item())

        hooks.append(attn.kv_a_layernorm.register_forward_hook(keep))
        hooks.append(attn.kv_a_proj_with_mqa.register_forward_hook(lambda m, a, o, i=i, s=attn.kv_lora_rank: keep(
            m, a, o, i=i, start=s)))

    def loop(m):
        with torch.no_grad():
            m(input_ids=ids)

    recipe = load_recipe("models/deepseek-ai/DeepSeek-V3/nvfp4", overrides={"kv_cache": "fp8"})
    modelopt_k3.quantize(model, recipe, loop, verbose=False)
    for h in hooks:
        h.remove()
    out = _stored(modelopt_k3.export_checkpoint(model, tmp_path / "export", progress=False))
    for i in range(3):
        k = out[f"model.layers.{i}.self_attn.k_proj.k_scale"]
        assert torch.equal(k, out[f"model.layers.{i}.self_attn.v_proj.v_scale"])
        assert k.item() == pytest.approx(seen[f"{i}"] / 448.0, rel=1e-6), i


def test_the_planner_counts_block_fp8_weights_at_their_loaded_size(deepseek_fp8_ckpt: Path) -> None:
    """Block-FP8 weights are dequantized as they load: the planner counts a stored 1-byte weight at the run's
    dtype (2 bytes in BF16) and a routed expert at its decoded size, not as stored."""
    import torch

    from modelopt_k3.memory.inventory import read_layout

    layout = read_layout(deepseek_fp8_ckpt)
    fp8 = [t for t in layout.dense if t.dtype == torch.float8_e4m3fn]
    assert fp8 and all(layout.load_dtype(t, torch.bfloat16) == torch.bfloat16 for t in fp8)
    group = layout.experts[0]
    assert group.decoded_numel_per_expert * 1 <= group.stored_bytes_per_expert  # stored: 1 byte + scales
    assert group.decoded_numel_per_expert * 2 > group.stored_bytes_per_expert  # loaded BF16: twice the codes


def test_int4_load_reads_every_weight_shape_and_refuses_one_that_disagrees(deepseek_int4_ckpt, tmp_path):
    """compressed-tensors' ``weight_shape`` is a declaration beside the codes: every one is read and compared
    with the shape the codes decode to, and a disagreeing one is refused naming it (was: consumed unread, so
    a checkpoint compressed-tensors would unpack to another shape loaded silently)."""
    import modelopt_k3
    from modelopt_k3.load import LoadError

    model = modelopt_k3.load_pretrained(deepseek_int4_ckpt, progress=False)
    assert set(model.modelopt_k3.keys_read) == set(_stored(deepseek_int4_ckpt))
    broken = tmp_path / "broken"
    shutil.copytree(deepseek_int4_ckpt, broken)
    key = "model.layers.2.mlp.experts.5.down_proj.weight_shape"
    shard = broken / json.loads((broken / "model.safetensors.index.json").read_text())["weight_map"][key]
    tensors = _stored_file(shard)
    tensors[key] = tensors[key].flip(0).contiguous()  # [in, out]: the transposed declaration
    save_file(tensors, str(shard))
    with pytest.raises(LoadError, match=rf"{key} declares shape \[\d+, \d+\], but .*experts\.5\.down_proj\.weight_packed"):
        modelopt_k3.load_pretrained(broken, progress=False)
