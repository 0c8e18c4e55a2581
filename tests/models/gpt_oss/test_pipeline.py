"""GPT-OSS through the pipeline: the checkpoint view, logits against transformers' own model, the converter
against the model path, and expert parallelism against one process (hf_ptq end to end)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _exports import read_export
from _mp import run_ranks
from dist.test_expert_parallel import EP_ENV, _ep_ptq, assert_exports_equal
from safetensors import safe_open
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from modelopt_k3.checkpoint import CheckpointReader
from modelopt_k3.models.gpt_oss import GptOssFusedExperts
from modelopt_k3.numerics import nvfp4_dequantize

EXPERTS_RECIPE = "models/openai/gpt-oss/nvfp4_experts"
LAYER0 = "model.layers.0.mlp.experts"


def _stored(ckpt: Path, key: str) -> torch.Tensor:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(ckpt / index[key], framework="pt") as f:
        return f.get_tensor(key)


def test_view_shows_each_experts_bytes(tiny_gpt_oss_ckpt: Path) -> None:
    """The fused MXFP4 tensors appear as per-expert weight_packed/weight_scale byte ranges, read by pread."""
    blocks, scales = _stored(tiny_gpt_oss_ckpt, f"{LAYER0}.gate_up_proj_blocks"), _stored(tiny_gpt_oss_ckpt, f"{LAYER0}.gate_up_proj_scales")
    with CheckpointReader(tiny_gpt_oss_ckpt) as reader:
        assert f"{LAYER0}.gate_up_proj_blocks" not in reader and f"{LAYER0}.gate_up_proj_bias" in reader
        for e in range(blocks.shape[0]):
            packed = reader.get(f"{LAYER0}.{e}.gate_up_proj.weight_packed")
            assert torch.equal(packed, blocks[e].reshape(blocks.shape[1], -1))
            assert torch.equal(reader.get(f"{LAYER0}.{e}.gate_up_proj.weight_scale"), scales[e])
        assert torch.equal(reader.get_rows(f"{LAYER0}.1.gate_up_proj.weight_packed", 3, 7),
                           blocks[1].reshape(blocks.shape[1], -1)[3:7])
        assert reader.log.bytes == blocks.numel() + scales.numel() + 4 * blocks.shape[-1] * blocks.shape[-2]


def _load_as_rank(ckpt: Path, ep_rank: int, ep_size: int):
    """What ``load_pretrained`` does on one expert-parallel rank, in this process (no peers needed: the load
    itself exchanges nothing)."""
    import dataclasses

    from modelopt_k3.dist.group import current_group
    from modelopt_k3.dist.placement import ExpertPlacement
    from modelopt_k3.load import pretrained as L
    from modelopt_k3.run.planning import library_config, plan_library_load

    config = library_config(ckpt, plan="whole", trust_remote_code=False, dtype=torch.float32, ep_degree=None,
                            dense="replicated", experts="bf16", allow_nonfinite_passthrough=False)
    run = plan_library_load(config, rank=0, world_size=1, device=torch.device("cpu"))  # load_pretrained's plan
    src, plan = L._planned_source(run), run.distribution
    placement = dataclasses.replace(plan.build_placement(), experts=ExpertPlacement(4, ep_size=ep_size, ep_rank=ep_rank))
    converters = L._prepare(src, ckpt, plan)
    model = L._build_placed_on_meta(src, plan, placement, torch.float32, current_group())
    L.materialize(model, plan.device)
    L.tie_as_stored(model, src.reader)
    info = L.LoadInfo(checkpoint=ckpt, spec=src.spec, plan=plan, placement=placement, model_cls=src.model_cls)
    build = L.PlacedBuild(model, src.reader, converters, info, current_group())
    L.read_scope(build, None, allow_nonfinite_passthrough=False, progress=False)  # the load's one read path
    return model, info


@pytest.mark.slow
def test_expert_parallel_rank_reads_only_its_experts(tiny_gpt_oss_ckpt: Path) -> None:
    """Rank 1 of 2 holds experts 2..3 and reads exactly their bytes: MXFP4 rows by the view, biases by rows."""
    from modelopt_k3.numerics import mxfp4_decode

    model, info = _load_as_rank(tiny_gpt_oss_ckpt, ep_rank=1, ep_size=2)
    experts = model.model.layers[0].mlp.experts
    assert experts.num_experts == 2 and experts.placement.local == range(2, 4)
    blocks = _stored(tiny_gpt_oss_ckpt, f"{LAYER0}.gate_up_proj_blocks")
    scales = _stored(tiny_gpt_oss_ckpt, f"{LAYER0}.gate_up_proj_scales")
    want = mxfp4_decode(blocks[2:4].flatten(-2), scales[2:4], torch.float32)
    assert torch.equal(experts.gate_up_proj.data, want)
    assert torch.equal(experts.down_proj_bias.data, _stored(tiny_gpt_oss_ckpt, f"{LAYER0}.down_proj_bias")[2:4].float())
    expert_keys = {k for k in info.keys_read if ".mlp.experts." in k and not k.endswith("_bias")}
    assert {int(k.split(".mlp.experts.")[1].split(".")[0]) for k in expert_keys} == {2, 3}
    with CheckpointReader(tiny_gpt_oss_ckpt) as reader:
        total = sum(i.nbytes for i in reader.headers().values())
        experts_total = sum(i.nbytes for k, i in reader.headers().items() if ".mlp.experts." in k)
    assert info.bytes_read == total - experts_total // 2  # half of every expert tensor (biases included)


@pytest.mark.slow
def test_logits_equal_transformers_own_model(tiny_gpt_oss_ckpt: Path) -> None:
    """Our load (fused experts on transformers' instances) == transformers' GptOssForCausalLM on the same checkpoint."""
    from transformers import GptOssForCausalLM
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from modelopt_k3 import load_pretrained

    ours = load_pretrained(tiny_gpt_oss_ckpt, dtype=torch.float32, progress=False)
    ref = GptOssForCausalLM.from_pretrained(tiny_gpt_oss_ckpt, dtype=torch.float32).eval()
    assert all(isinstance(layer.mlp.experts, GptOssFusedExperts) for layer in ours.model.layers)
    assert all(type(layer.mlp.experts) is GptOssExperts for layer in ref.model.layers)  # transformers' untouched
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = ours(input_ids=ids).logits, ref(input_ids=ids).logits
    # Same math; only the order of the fp32 sum over a token's k experts differs (transformers: index_add_
    # in expert order), so ~1 ulp of fp32 per layer.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def converted(tiny_gpt_oss_ckpt: Path, tmp_path_factory) -> Path:
    from modelopt_k3.convert import convert_checkpoint
    from modelopt_k3.recipe import load_recipe

    out = tmp_path_factory.mktemp("gpt_oss_conv") / "out"
    report = convert_checkpoint(tiny_gpt_oss_ckpt, out, load_recipe(EXPERTS_RECIPE))
    assert report.complete and report.stats.expert_blocks_requantized == 0
    return out


@pytest.mark.slow
def test_converter_equals_model_path_and_is_lossless(tiny_gpt_oss_ckpt: Path, converted: Path, tmp_path: Path) -> None:
    from modelopt_k3 import export_checkpoint, load_pretrained, quantize
    from modelopt_k3.recipe import load_recipe

    model = load_pretrained(tiny_gpt_oss_ckpt, progress=False)
    quantize(model, load_recipe(EXPERTS_RECIPE), None, verbose=False)
    export_checkpoint(model, tmp_path / "model_path", progress=False)
    mine, theirs = read_export(converted), read_export(tmp_path / "model_path")
    assert set(mine) == set(theirs)
    differ = [k for k in mine if mine[k].dtype != theirs[k].dtype
              or not torch.equal(mine[k].reshape(-1).view(torch.uint8), theirs[k].reshape(-1).view(torch.uint8))]
    assert differ == []
    for name in ("config.json", "hf_quant_config.json"):
        assert json.loads((converted / name).read_text()) == json.loads((tmp_path / "model_path" / name).read_text())
    # Read back as an engine does (per expert): exactly transformers' own dequantization of the source.
    for proj in ("gate_up_proj", "down_proj"):
        ref = convert_moe_packed_tensors(_stored(tiny_gpt_oss_ckpt, f"{LAYER0}.{proj}_blocks"),
                                         _stored(tiny_gpt_oss_ckpt, f"{LAYER0}.{proj}_scales"), dtype=torch.float32)
        for e in range(ref.shape[0]):
            p = f"{LAYER0}.{e}.{proj}"
            w = nvfp4_dequantize(mine[f"{p}.weight"], mine[f"{p}.weight_scale"], mine[f"{p}.weight_scale_2"])
            assert torch.equal(w, ref[e].T), p
            assert float(mine[f"{p}.input_scale"]) == 1.0
    # Expert biases, sinks and the router are the source's bytes under their own names.
    for key in (f"{LAYER0}.gate_up_proj_bias", "model.layers.0.self_attn.sinks", "model.layers.0.mlp.router.weight"):
        assert torch.equal(mine[key].view(torch.int16), _stored(tiny_gpt_oss_ckpt, key).view(torch.int16)), key


PTQ_ARGS = ["--recipe", "models/openai/gpt-oss/nvfp4", "--calib_size", "8", "--batch_size", "2", "--calib_seq", "32",
            "--report", "none", "--no_progress"]


@pytest.mark.multiprocess
def test_hf_ptq_two_rank_export_equals_one_process(tiny_gpt_oss_ckpt: Path, tmp_path: Path) -> None:
    """hf_ptq --pyt_ckpt_path <tiny GPT-OSS> end to end, calibrated NVFP4 (experts by the lossless cast, attention
    calibrated); 2 expert-parallel ranks write the same checkpoint as one process (activation scales within 1%)."""
    single, ep = tmp_path / "single", tmp_path / "ep2"
    from modelopt_k3.cli import hf_ptq

    assert hf_ptq.main([*PTQ_ARGS, "--pyt_ckpt_path", str(tiny_gpt_oss_ckpt), "--export_path", str(single)]) == 0
    results = run_ranks(2, _ep_ptq, [*PTQ_ARGS, "--pyt_ckpt_path", str(tiny_gpt_oss_ckpt), "--export_path", str(ep)],
                        timeout=300, env=EP_ENV)
    assert [x.exitcode for x in results] == [0, 0], [x.traceback for x in results]
    assert_exports_equal(single, ep)
    algos = json.loads((single / "hf_quant_config.json").read_text())["quantization"]
    assert algos["quant_algo"] == "NVFP4" and "model.layers.0.self_attn*" not in algos["exclude_modules"]
    out = read_export(single)
    assert f"{LAYER0}.3.gate_up_proj.weight_scale_2" in out and "model.layers.0.self_attn.q_proj.weight_scale_2" in out
    # q/k/v read one input: one weight_scale_2 and input_scale (the shared-input probe found the group).
    q, k = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"
    assert torch.equal(out[f"{q}.weight_scale_2"], out[f"{k}.weight_scale_2"])
    assert torch.equal(out[f"{q}.input_scale"], out[f"{k}.input_scale"])


@pytest.mark.slow
def test_engines_refuse_nvfp4_experts_with_the_cited_reason(converted: Path) -> None:
    """vLLM 0.33 refuses ModelOpt NVFP4 GPT-OSS experts; SGLang 0.5.23 skips the converter's per-expert tensors
    without an error and serves different numbers (models/gpt_oss/serving.py)."""
    from modelopt_k3.check import check_export

    report = check_export(converted, ("vllm", "sglang", "trtllm"))
    results = report.results
    assert {e: r.verdict for e, r in results.items()} == {
        "vllm": "refuses", "sglang": "loads but serves different numbers", "trtllm": "refuses"}
    assert "_load_unquantized_expert" in results["vllm"].refusals[0].reason
    assert [d.module for d in results["sglang"].deviations] == [f"model.layers.{i}.mlp.experts" for i in (0, 1)]
    assert "_load_normal_weights" in results["sglang"].deviations[0].what
    assert "load_hf_weights" in results["trtllm"].refusals[0].reason
    assert results["vllm"].refusals[0].tensor.startswith("model.layers.0.mlp.experts.0.")
