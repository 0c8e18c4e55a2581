"""Views that cannot be fooled and one source check for both paths (issue 31).

A GPT-OSS checkpoint view refuses a stored tensor that collides with a per-expert name it derives, and a fused
tensor that is not the OpenAI layout, naming the stored tensor. The converter refuses what ``load_pretrained``
(hf_ptq's load) refuses, from the same check of the model built on meta (transformers' own classes run no
checkpoint code); a Qwen3-MoE with tied embeddings and no ``lm_head.weight`` loads tied, as transformers does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import copy_checkpoint
from safetensors.torch import save_file

import modelopt_k3
from modelopt_k3.checkpoint import CheckpointError, CheckpointReader
from modelopt_k3.testing.qwen3_moe import make_tiny_qwen3_moe
from modelopt_k3.testing.tiny_gpt_oss import make_tiny_gpt_oss

from .helpers import tree_digest

W4A16 = ["--recipe", "presets/w4a16_nvfp4"]  # Qwen3-MoE has no calibration-free default recipe
GPT_EXPERTS = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("views")
    return {"gpt_oss": make_tiny_gpt_oss(root / "g", seed=0), "qwen3_moe": make_tiny_qwen3_moe(root / "q", seed=0)}


def _add(ckpt: Path, key: str, tensor: torch.Tensor) -> Path:
    """Store one more tensor, in a shard of its own listed by the index."""
    save_file({key: tensor}, str(ckpt / "extra.safetensors"), metadata={"format": "pt"})
    index = ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][key] = "extra.safetensors"
    index.write_text(json.dumps(data))
    return ckpt


def _convert(run_tool, src: Path, dst: Path, *extra) -> tuple[int, str]:
    rc, _, err = run_tool("convert", ["--src", src, "--dst", dst, *extra])
    return rc, err


def _collided(sources, tmp_path) -> Path:
    c = copy_checkpoint(sources["gpt_oss"], tmp_path / "collide")
    return _add(c, f"{GPT_EXPERTS}.0.down_proj.weight_packed", torch.zeros(32, 32, dtype=torch.uint8))


def test_a_stored_key_colliding_with_a_derived_name_is_refused_by_both_paths(sources, tmp_path, run_tool) -> None:
    src = _collided(sources, tmp_path)
    before = tree_digest(src)
    stored = f"stored tensor {GPT_EXPERTS}.0.down_proj.weight_packed"
    with pytest.raises(CheckpointError, match=f"{stored} has the name the checkpoint view gives expert 0 of stored "
                                              f"{GPT_EXPERTS}.down_proj_blocks"):
        CheckpointReader(src)
    rc, err = _convert(run_tool, src, tmp_path / "out")
    assert rc == 2 and stored in err and err.count("\n") == 1, err  # was: exit 0, expert 0's codes replaced
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.safetensors"))
    with pytest.raises(CheckpointError, match=stored):  # was: KeyError: 'down_proj' (a traceback)
        modelopt_k3.load_pretrained(src, progress=False)
    assert tree_digest(src) == before


def test_a_fused_tensor_not_in_the_openai_layout_is_refused_naming_it(sources, tmp_path) -> None:
    key = f"{GPT_EXPERTS}.gate_up_proj_blocks"
    with CheckpointReader(sources["gpt_oss"]) as reader:
        good = reader._stored[key]
    flat = torch.zeros(good.shape[0], good.shape[1], good.shape[2] * good.shape[3], dtype=torch.uint8)
    src = copy_checkpoint(sources["gpt_oss"], tmp_path / "flat", replace={key: flat})
    with pytest.raises(CheckpointError, match=f"stored tensor {key} is torch.uint8 .* not the OpenAI MXFP4 layout"):
        CheckpointReader(src)


def test_a_mis_shaped_expert_is_named_by_its_stored_tensor(sources, tmp_path) -> None:
    src = copy_checkpoint(sources["gpt_oss"], tmp_path / "lie",
                          edit_config=lambda c: c.update(intermediate_size=2 * c["intermediate_size"]))
    with pytest.raises(CheckpointError) as e:
        modelopt_k3.load_pretrained(src, progress=False)
    msg = str(e.value)
    assert f"{GPT_EXPERTS}.gate_up_proj_blocks (per expert" in msg and f"{GPT_EXPERTS}.down_proj_blocks" in msg, msg


def _bias_missing(s, t):
    return copy_checkpoint(s["gpt_oss"], t, drop=[f"{GPT_EXPERTS}.down_proj_bias"])


def _router_missing(s, t):
    return copy_checkpoint(s["qwen3_moe"], t, drop=["model.layers.0.mlp.gate.weight"])


def _stray(s, t):
    return _add(copy_checkpoint(s["qwen3_moe"], t), "model.layers.0.self_attn.kv_a_proj.weight",
                torch.zeros(16, 16, dtype=torch.bfloat16))


def _quantized(s, t):
    return copy_checkpoint(s["qwen3_moe"], t, edit_config=lambda c: c.update(quantization_config={"quant_method": "fp8"}))


@pytest.mark.parametrize(("make", "named"), [
    (_bias_missing, f"1 missing: {GPT_EXPERTS}.down_proj_bias"),
    (_router_missing, "1 missing: model.layers.0.mlp.gate.weight"),
    (_stray, "1 unexpected: model.layers.0.self_attn.kv_a_proj.weight"),
    (_quantized, "already quantized (config.json has a quantization_config)"),
], ids=["gpt-oss-expert-bias-missing", "qwen3-router-missing", "stray-tensor", "qwen3-quantization-config"])
def test_the_converter_refuses_what_the_model_path_refuses(make, named, sources, tmp_path, run_tool) -> None:
    src = make(sources, tmp_path / "src")
    extra = W4A16 if json.loads((src / "config.json").read_text())["model_type"] == "qwen3_moe" else []
    rc, err = _convert(run_tool, src, tmp_path / "out", *extra)
    assert rc == 2 and named in err and err.count("\n") == 1, err  # was: exit 0, an incomplete export
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        modelopt_k3.load_pretrained(src, progress=False)


def test_tied_embeddings_without_lm_head_load_as_transformers_does(sources, tmp_path, run_tool) -> None:
    from transformers import Qwen3MoeForCausalLM

    src = copy_checkpoint(sources["qwen3_moe"], tmp_path / "tied", drop=["lm_head.weight"],
                          edit_config=lambda c: c.update(tie_word_embeddings=True))
    model = modelopt_k3.load_pretrained(src, progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference = Qwen3MoeForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    ids = torch.arange(24).reshape(2, 12)
    with torch.no_grad():
        ours, theirs = model(input_ids=ids).logits, reference(input_ids=ids).logits
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=0, atol=0)
    rc, err = _convert(run_tool, src, tmp_path / "out", *W4A16)
    assert rc == 0, err


def test_the_planner_sees_gpt_oss_experts_as_stored(sources, capsys) -> None:
    """Through the reader's view: was "0 MoE layers" and packed experts refused as "stored decoded"."""
    from modelopt_k3.cli.plan import main as plan_main
    from modelopt_k3.memory.inventory import read_layout

    config = json.loads((sources["gpt_oss"] / "config.json").read_text())
    layout = read_layout(sources["gpt_oss"])
    assert len(layout.experts) == config["num_hidden_layers"] and layout.packed_source
    assert layout.num_experts == config["num_local_experts"]
    assert plan_main(["--pyt_ckpt_path", str(sources["gpt_oss"]), "--world_size", "2", "--gpu_mem_gib", "80"]) == 0
    out = capsys.readouterr().out
    assert f"{config['num_hidden_layers']} MoE layers x {config['num_local_experts']} experts" in out, out
    assert f"(top-{config['num_experts_per_tok']})" in out and "stores them decoded" not in out, out
