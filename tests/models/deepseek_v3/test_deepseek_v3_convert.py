"""The calibration-free converter on DeepSeek-V3 sources (block-FP8, INT4 experts, BF16): weight-only NVFP4
(``models/deepseek-ai/DeepSeek-V3/w4a16_nvfp4``, the converter's default for the model), byte for byte what the
model path (load_pretrained -> quantize without data -> export_checkpoint) writes for the same recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _exports import read_export

from modelopt_k3.check import check_export
from modelopt_k3.check.report import LOADS, REFUSES
from modelopt_k3.convert import STATE_DIR, convert_checkpoint
from modelopt_k3.numerics import block_fp8_decode
from modelopt_k3.testing.deepseek_v3 import make_tiny_deepseek_v3

from .conftest import W4A16, weight_only_export

SOURCES = ("block_fp8", "int4", "bf16")
INDEX = "model.safetensors.index.json"
MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:10]
    return sorted(k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
                  or not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)))


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def sources(deepseek_fp8_ckpt: Path, deepseek_int4_ckpt: Path, deepseek_bf16_ckpt: Path) -> dict[str, Path]:
    return {"block_fp8": deepseek_fp8_ckpt, "int4": deepseek_int4_ckpt, "bf16": deepseek_bf16_ckpt}


@pytest.fixture(scope="module")
def both_paths(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """source -> (converter output, model-path export), both with the weight-only recipe."""
    out = {}
    for source, ckpt in sources.items():
        root = tmp_path_factory.mktemp(f"deepseek_v3_convert_{source}")
        convert_checkpoint(ckpt, root / "converted", W4A16)
        out[source] = root / "converted", weight_only_export(ckpt, root / "model_path")
    return out


@pytest.mark.parametrize("source", SOURCES)
def test_converter_equals_the_model_path(source: str, both_paths) -> None:
    """Same names, dtypes and bytes, same config.json and hf_quant_config.json, for every source format."""
    converted, model_path = both_paths[source]
    mine, theirs = read_export(converted), read_export(model_path)
    assert _differing(mine, theirs) == []
    for name in ("config.json", "hf_quant_config.json"):
        assert _json(converted / name) == _json(model_path / name), name
    # What was compared: routed and shared experts, the dense MLP and o_proj NVFP4; nothing left encoded.
    for module in ("model.layers.2.mlp.experts.7.up_proj", "model.layers.1.mlp.shared_experts.down_proj",
                   "model.layers.0.mlp.gate_proj", "model.layers.0.self_attn.o_proj"):
        assert mine[f"{module}.weight"].dtype == torch.uint8 and f"{module}.weight_scale_2" in mine, module
        assert f"{module}.input_scale" not in mine  # weight-only
    assert not any(k.endswith(("weight_scale_inv", "weight_packed", "weight_shape")) for k in mine)
    assert not any(t.dtype == torch.float8_e4m3fn and not k.endswith(".weight_scale") for k, t in mine.items())
    hf_quant = _json(converted / "hf_quant_config.json")["quantization"]
    assert hf_quant["quant_algo"] == "W4A16_NVFP4"
    assert {f"model.layers.0.self_attn.{p}" for p in MLA} <= set(hf_quant["exclude_modules"])


def test_kept_block_fp8_linears_are_written_decoded(sources, both_paths) -> None:
    """The MLA projections a block-FP8 source stores FP8 are written as the declared-block decode of the source
    in the model's dtype (bf16), as the model path writes them; the 160-row kv_a_proj_with_mqa has a partial block."""
    src = read_export(sources["block_fp8"])
    mine = read_export(both_paths["block_fp8"][0])
    for layer in range(3):
        for proj in MLA:
            key = f"model.layers.{layer}.self_attn.{proj}"
            want = block_fp8_decode(src[f"{key}.weight"], src[f"{key}.weight_scale_inv"], (128, 128), torch.bfloat16)
            assert mine[f"{key}.weight"].dtype == torch.bfloat16
            assert torch.equal(mine[f"{key}.weight"], want), key


def test_converted_exports_get_the_model_paths_verdicts(both_paths) -> None:
    """modelopt-k3-check: vLLM and SGLang load the converted export as they load the model path's;
    TensorRT-LLM refuses both (W4A16_NVFP4 is no QuantAlgo of the versions read)."""
    engines = ("vllm", "sglang", "trtllm")
    for source, (converted, model_path) in both_paths.items():
        got = {e: r.verdict for e, r in check_export(converted, engines).results.items()}
        assert got == {e: r.verdict for e, r in check_export(model_path, engines).results.items()}, source
        assert got == {"vllm": LOADS, "sglang": LOADS, "trtllm": REFUSES}, source


def test_the_default_recipe_is_weight_only_nvfp4(deepseek_fp8_ckpt: Path, both_paths, tmp_path: Path) -> None:
    """modelopt-k3-convert without --recipe converts DeepSeek-V3 with the weight-only recipe."""
    from modelopt_k3.cli.convert import main

    out = tmp_path / "default"
    assert main(["--src", str(deepseek_fp8_ckpt), "--dst", str(out), "--no_progress"]) in (0, None)
    assert _json(out / "hf_quant_config.json")["modelopt_k3"]["recipe"] == W4A16
    assert _differing(read_export(out), read_export(both_paths["block_fp8"][0])) == []


def _partner(module: str) -> str:
    head, _, proj = module.rpartition(".")
    return f"{head}.{ {'gate_proj': 'up_proj', 'up_proj': 'gate_proj'}.get(proj, proj) }"


@pytest.mark.parametrize("source", ["block_fp8", "int4"])
def test_each_rank_reads_only_its_shards_and_scale_partners(source: str, tmp_path: Path) -> None:
    """Two ranks, many shards: each shard's record lists the source tensors it read; all are stored in that
    shard, or belong to a module whose main tensor it holds (a scale stored in the next shard) or to that
    module's gate/up partner (their shared weight_scale_2 needs both weights); every source tensor is read by
    some shard; the two ranks' output equals one process's."""
    ckpt = make_tiny_deepseek_v3(tmp_path / "ckpt", source=source, max_shard_size=120_000)
    wmap = json.loads((ckpt / INDEX).read_text())["weight_map"]
    files = sorted(set(wmap.values()))
    assert len(files) >= 8
    out = tmp_path / "two_ranks"
    convert_checkpoint(ckpt, out, W4A16, rank=0, world_size=2)
    assert sorted(p.stem for p in (out / STATE_DIR / "shards").glob("*.json")) == files[0::2]  # rank 0's only
    convert_checkpoint(ckpt, out, W4A16, rank=1, world_size=2)
    read_somewhere: set[str] = set()
    for f in files:
        record = _json(out / STATE_DIR / "shards" / f"{f}.json")
        here = {k for k, v in wmap.items() if v == f}
        # modules whose main tensor (weight / weight_packed) is here: the shard converts them, reading the rest
        anchors = {k.rpartition(".")[0] for k in here if k.endswith((".weight", ".weight_packed"))}
        for key in record["source"]["read"]:
            module = key.rpartition(".")[0]
            assert key in here or module in anchors or _partner(module) in anchors, (f, key)
        read_somewhere |= set(record["source"]["read"])
    weight_shapes = {k for k in wmap if k.endswith(".weight_shape")}  # INT4's, consumed unread (as the model path)
    assert read_somewhere == set(wmap) - weight_shapes
    assert _differing(read_export(out), read_export(convert_checkpoint(ckpt, tmp_path / "one", W4A16).dst)) == []


@pytest.mark.parametrize("lie", ["swapped", "negative", "three_d"])
def test_the_converter_refuses_an_int4_weight_shape_the_load_refuses(deepseek_int4_ckpt: Path, tmp_path: Path,
                                                                   lie: str) -> None:
    """One rule for both paths (issue 42): an INT4 ``weight_shape`` that disagrees with its codes (swapped,
    negative, 3-d) was converted by ``modelopt-k3-convert`` while ``hf_ptq`` refused it; now both refuse it,
    naming the tensor, and nothing is published."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    import modelopt_k3
    from modelopt_k3.checkpoint import CheckpointError
    from modelopt_k3.load import LoadError

    broken = tmp_path / "broken"
    shutil.copytree(deepseek_int4_ckpt, broken)
    key = "model.layers.2.mlp.experts.5.down_proj.weight_shape"
    shard = broken / _json(broken / "model.safetensors.index.json")["weight_map"][key]
    with safe_open(str(shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    good = tensors[key]
    tensors[key] = {"swapped": good.flip(0), "negative": -good,
                    "three_d": torch.cat([good.new_ones(1), good])}[lie].contiguous()
    save_file(tensors, str(shard))
    said = rf"{key} declares shape \[.*\], but .*experts\.5\.down_proj\.weight_packed"
    with pytest.raises(CheckpointError, match=said):
        convert_checkpoint(broken, tmp_path / "out", W4A16)
    assert not (tmp_path / "out").exists() or not (tmp_path / "out" / "model.safetensors.index.json").exists()
    with pytest.raises(LoadError, match=said):
        modelopt_k3.load_pretrained(broken, progress=False)


def _edited_copy(src: Path, dst: Path, key: str, edit) -> Path:
    """A copy of ``src`` with stored tensor ``key`` replaced by ``edit(tensor)`` (None: removed, with its index entry)."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    index = _json(dst / "model.safetensors.index.json")
    shard = dst / index["weight_map"][key]
    with safe_open(str(shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    value = edit(tensors.pop(key))
    if value is None:
        del index["weight_map"][key]
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        tensors[key] = value.contiguous()
    save_file(tensors, str(shard))
    return dst


def test_a_missing_int4_weight_shape_is_named_missing_by_both_paths(deepseek_int4_ckpt: Path, tmp_path: Path) -> None:
    """Issue 42: the converter said "not MXFP4-packed" (judging the two fields left by MXFP4's rule); both paths
    now name the missing tensor."""
    import modelopt_k3
    from modelopt_k3.checkpoint import CheckpointError
    from modelopt_k3.quant.decisions import InventoryError

    key = "model.layers.2.mlp.experts.5.down_proj.weight_shape"
    broken = _edited_copy(deepseek_int4_ckpt, tmp_path / "broken", key, lambda t: None)
    with pytest.raises(CheckpointError, match=rf"missing {key}") as err:
        convert_checkpoint(broken, tmp_path / "out", W4A16)
    assert "MXFP4" not in str(err.value)
    # the library load refuses it while planning (the run's decision table reads every expert's fields), as
    # hf_ptq's preflight does, before any weight is read
    with pytest.raises(InventoryError, match=rf"missing {key}"):
        modelopt_k3.load_pretrained(broken, progress=False)


def test_a_block_fp8_scale_of_the_wrong_shape_is_refused_naming_its_weight(deepseek_fp8_ckpt: Path, tmp_path: Path) -> None:
    """Issue 42: the shape error named no tensor; both paths now say which Linear's scale it is."""
    import modelopt_k3

    key = "model.layers.0.self_attn.q_b_proj.weight_scale_inv"
    broken = _edited_copy(deepseek_fp8_ckpt, tmp_path / "broken", key, lambda t: t[:-1])
    said = r"model\.layers\.0\.self_attn\.q_b_proj\.weight: weight_scale_inv of a \[\d+, \d+\] weight .* must be"
    with pytest.raises(ValueError, match=said):
        convert_checkpoint(broken, tmp_path / "out", W4A16)
    with pytest.raises(ValueError, match=said):
        modelopt_k3.load_pretrained(broken, progress=False)
