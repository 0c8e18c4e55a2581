"""Block-FP8 passthrough (issue 32): Linears a recipe keeps FP8 (``fp8_pb``, FP8_PB_WO) on a block-FP8 source are
written as the source's E4M3 codes and ``weight_scale_inv`` (as ``weight_scale`` [R, 1, C, 1]), not requantized
from the decoded weight; the converter copies the same bytes; fake quant is the source's decode; a Linear whose
source cannot be held (lm_head, stored BF16; another block) is requantized and labelled so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _exports import read_export
from _mp import run_ranks
from safetensors.torch import load_file, save_file

from modelopt_k3.numerics import block_fp8_decode
from modelopt_k3.numerics.fp8 import fp8_dequantize_blockwise
from modelopt_k3.quant.block_fp8_source import PASSTHROUGH, block_fp8_passthrough
from modelopt_k3.quant.schemes import FP8_BLOCK_TENSOR, NVFP4_TENSOR

# Weight-only (calibration-free, so the converter takes it too): the MLA projections and o_proj kept FP8 as
# stored, lm_head (stored BF16) fp8_pb as well, the MLPs and experts NVFP4.
RECIPE = """\
description: test recipe, MLA projections and o_proj kept block-FP8
algorithm: max
kv_cache: null
quant_cfg:
  - pattern: "*"
    weights: nvfp4
    inputs: null
  - import: units/default_disabled
  - pattern: "*.self_attn.*"
    weights: fp8_pb
    inputs: null
    must_match: true
  - pattern: "lm_head"
    weights: fp8_pb
    inputs: null
    must_match: true
"""
PROJS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
KEPT = [f"model.layers.{layer}.self_attn.{proj}" for layer in range(3) for proj in PROJS]
EP_ENV = {"MODELOPT_K3_DIST_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


@pytest.fixture(scope="module")
def fp8_ckpt(deepseek_fp8_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in with every ``weight_scale_inv`` scaled by 1.3 in fp32. The stand-in's own scales are a BF16
    amax / 448, for which requantizing the BF16 decode gives the source's bytes back; a hub checkpoint's scales
    are arbitrary fp32 values (as these), whose BF16 decode requantizes to other scales and codes."""
    dst = tmp_path_factory.mktemp("fp8_fp32_scales") / "ckpt"
    shutil.copytree(deepseek_fp8_ckpt, dst)
    for file in sorted(dst.glob("*.safetensors")):
        tensors = load_file(file)
        if any(k.endswith(".weight_scale_inv") for k in tensors):
            tensors = {k: t * 1.3 if k.endswith(".weight_scale_inv") else t for k, t in tensors.items()}
            save_file(tensors, file, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("fp8_kept_recipe") / "fp8_kept.yaml"
    path.write_text(RECIPE)
    return str(path)


@pytest.fixture(scope="module")
def model_path(fp8_ckpt: Path, recipe: str, tmp_path_factory: pytest.TempPathFactory):
    """(quantized model, its export, source keys its export read): load, quantize without data, export."""
    import modelopt_k3

    model = modelopt_k3.load_pretrained(fp8_ckpt, progress=False)
    modelopt_k3.quantize(model, recipe, None, verbose=False)
    reader = model.modelopt_k3.source()
    before = len(reader.log.keys)
    out = modelopt_k3.export_checkpoint(model, tmp_path_factory.mktemp("fp8_kept") / "model_path", progress=False)
    return model, out, set(reader.log.keys[before:])


def test_kept_linears_are_written_as_the_source_bytes(fp8_ckpt: Path, model_path) -> None:
    """Every fp8_pb Linear: ``weight`` is the source's E4M3 bytes, ``weight_scale`` its ``weight_scale_inv`` as fp32
    [R, 1, C, 1], partial trailing blocks as the source declares them (kv_a_proj_with_mqa: 160 rows, 2 scale
    rows); read lazily by the export. lm_head, stored BF16, is requantized, and both are labelled."""
    model, out, read = model_path
    src, mine = read_export(fp8_ckpt), read_export(out)
    for name in KEPT:
        codes, scale = src[f"{name}.weight"], src[f"{name}.weight_scale_inv"]
        assert codes.dtype == torch.float8_e4m3fn
        assert _same(mine[f"{name}.weight"], codes), name
        assert _same(mine[f"{name}.weight_scale"], scale.float()[:, None, :, None].contiguous()), name
        assert not any(k.startswith(f"{name}.") and k.endswith("_scale_inv") for k in mine)
        assert {f"{name}.weight", f"{name}.weight_scale_inv"} <= read, name  # read again by the export
        assert model.modelopt_k3_quant.source_labels[name] == PASSTHROUGH
        assert model.modelopt_k3_quant.weight_algorithms[name] == "lossless_cast"
    kv_a = src["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert kv_a.shape[0] % 128 and mine["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale"].shape[0] == 2
    assert model.modelopt_k3_quant.source_labels["lm_head"].startswith("max (requantized: lm_head is not stored")
    assert mine["lm_head.weight"].dtype == torch.float8_e4m3fn and "lm_head.weight_scale" in mine
    layers = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    assert {layers[n]["quant_algo"] for n in KEPT} == {"FP8_PB_WO"}


def test_the_report_rows_say_passthrough(model_path) -> None:
    """The quantization report's dense rows: passed-through Linears labelled so (lossless_cast), lm_head's says why
    it is requantized."""
    from modelopt_k3.dist.group import current_group
    from modelopt_k3.report.collect import dense_rows

    model, _, _ = model_path
    rows = {r["name"]: r for r in dense_rows(model, model.modelopt_k3_quant, current_group())}
    for name in KEPT:
        assert (rows[name]["calibration"], rows[name]["weight_algorithm"]) == (PASSTHROUGH, "lossless_cast"), name
    assert rows["lm_head"]["calibration"].startswith("max (requantized:") and rows["lm_head"]["weight_algorithm"] == "max"


def test_passthrough_differs_from_requantizing_the_decoded_weight(fp8_ckpt: Path, model_path) -> None:
    """What the export would hold if it requantized the decoded BF16 weight (block amax / 448) differs from the
    source's bytes: a return to requantization turns the byte tests red."""
    model, out, _ = model_path
    mine, modules = read_export(out), dict(model.named_modules())
    blocks = 0
    for name in KEPT:
        requant = FP8_BLOCK_TENSOR.weight_tensors(modules[name].weight.detach(), None)
        scales_differ = requant["weight_scale"] != mine[f"{name}.weight_scale"]
        assert scales_differ.any(), name
        blocks += int(scales_differ.sum())
    assert blocks > len(KEPT)


def test_fake_quant_is_the_exports_dequantization(fp8_ckpt: Path, model_path) -> None:
    """Each passed-through weight's fake quant equals the export's dequantization (codes * scale, in the run's
    dtype) and the source's decode; with only those quantizers on, the logits are the unquantized model's (the
    loaded weight is the decode), while requantizing one of them moves them."""
    from modelopt_k3.quant.modules import iter_quantizers
    from modelopt_k3.testing.deepseek_v3 import calibration_token_ids

    model, out, _ = model_path
    mine, src, modules = read_export(out), read_export(fp8_ckpt), dict(model.named_modules())
    for name in KEPT:
        w = modules[name].weight.detach()
        dq = fp8_dequantize_blockwise(mine[f"{name}.weight"], mine[f"{name}.weight_scale"][:, 0, :, 0], w.dtype)
        assert torch.equal(modules[name].weight_quantizer.fake_quant(w), dq), name
        assert torch.equal(dq, block_fp8_decode(src[f"{name}.weight"], src[f"{name}.weight_scale_inv"], (128, 128), w.dtype))
    quantizers = dict(iter_quantizers(model))
    ids = calibration_token_ids()[:, :16]
    try:
        for q in quantizers.values():
            q.mode = "off"
        with torch.no_grad():
            ref = model(input_ids=ids).logits
        for name in KEPT:
            quantizers[f"{name}.weight_quantizer"].mode = "quant"
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, ref)
        wq = quantizers[f"{KEPT[0]}.weight_quantizer"]
        source, wq.block_source = wq.block_source, None  # requantized (the old path): different logits
        try:
            with torch.no_grad():
                assert not torch.equal(model(input_ids=ids).logits, ref)
        finally:
            wq.block_source = source
    finally:
        for q in quantizers.values():
            q.mode = "quant"


def test_the_converter_writes_the_model_paths_bytes(fp8_ckpt: Path, recipe: str, model_path,
                                                    tmp_path: Path) -> None:
    """modelopt-k3-convert with the same recipe: the passed-through Linears are copies (no decode), and the whole
    output, configs included, equals the model path's byte for byte."""
    from modelopt_k3.convert import convert_checkpoint

    _, out, _ = model_path
    report = convert_checkpoint(fp8_ckpt, tmp_path / "converted", recipe)
    theirs, mine = read_export(out), read_export(report.dst)
    assert set(mine) == set(theirs)
    assert [k for k in sorted(mine) if not _same(mine[k], theirs[k])] == []
    for name in ("config.json", "hf_quant_config.json"):
        assert json.loads((report.dst / name).read_text()) == json.loads((out / name).read_text()), name
    assert report.stats.tensors["passthrough"] == 2 * len(KEPT)


def test_refused_passthrough_names_why(fp8_ckpt: Path) -> None:
    """Another declared block, scales of another shape, a format that holds no block FP8: requantized, labelled."""
    from modelopt_k3.checkpoint import CheckpointReader
    from modelopt_k3.checkpoint.source_decode import dense_decodes
    from modelopt_k3.spec import get_spec

    reader = CheckpointReader(fp8_ckpt)
    dense = dense_decodes(reader, get_spec("deepseek_v3").loading.dense_converters)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa"
    shape = tuple(reader.headers()[f"{name}.weight"].shape)

    def config(block):
        return SimpleNamespace(quantization_config={"quant_method": "fp8", "weight_block_size": block})

    where, label = block_fp8_passthrough(name, FP8_BLOCK_TENSOR, shape, dense, reader.headers(), config([128, 128]))
    assert where is not None and label == PASSTHROUGH
    assert where.codes == f"{name}.weight" and where.scales == f"{name}.weight_scale_inv"
    where, label = block_fp8_passthrough(name, FP8_BLOCK_TENSOR, shape, dense, reader.headers(), config([64, 64]))
    assert where is None and "weight_block_size [64, 64] is not the [128, 128] block" in label
    headers = dict(reader.headers())
    headers[f"{name}.weight_scale_inv"] = headers[f"{name}.weight_scale_inv"]._replace(shape=(1, 2))
    where, label = block_fp8_passthrough(name, FP8_BLOCK_TENSOR, shape, dense, headers, config([128, 128]))
    assert where is None and "needs [2, 2]" in label
    where, label = block_fp8_passthrough(name, NVFP4_TENSOR, shape, dense, reader.headers(), config([128, 128]))
    assert where is None


def test_a_weight_algorithm_keeps_the_passthrough(fp8_ckpt: Path, model_path, tmp_path: Path) -> None:
    """Under mse (a weight algorithm, NVFP4 weights only) the fp8_pb Linears are still the source's bytes and
    recorded as the lossless cast."""
    import modelopt_k3

    _, one, _ = model_path
    recipe = tmp_path / "mse.yaml"
    recipe.write_text(RECIPE.replace("algorithm: max", "algorithm: {method: mse}"))
    model = modelopt_k3.load_pretrained(fp8_ckpt, progress=False)
    modelopt_k3.quantize(model, str(recipe), None, verbose=False)
    assert {model.modelopt_k3_quant.weight_algorithms[n] for n in KEPT} == {"lossless_cast"}
    mine = read_export(modelopt_k3.export_checkpoint(model, tmp_path / "export", progress=False))
    theirs = read_export(one)
    assert all(_same(mine[f"{n}.{t}"], theirs[f"{n}.{t}"]) for n in KEPT for t in ("weight", "weight_scale"))


def _ep_export(ckpt: str, recipe: str, out: str, dense: str) -> list[str]:
    """EP 2 (dense part ``dense``), weight-only: quantize with ``recipe``, export; the source keys this rank's
    export read."""
    import modelopt_k3
    from modelopt_k3.dist.group import run_group

    with run_group():
        model = modelopt_k3.load_pretrained(ckpt, dense=dense, progress=False)
        modelopt_k3.quantize(model, recipe, None, verbose=False)
        reader = model.modelopt_k3.source()
        before = len(reader.log.keys)
        modelopt_k3.export_checkpoint(model, out, progress=False)
        return list(reader.log.keys[before:])


@pytest.mark.multiprocess
@pytest.mark.parametrize("dense", ["replicated", "fsdp2"])
def test_ep2_each_rank_reads_only_the_source_bytes_it_writes(fp8_ckpt: Path, recipe: str, model_path,
                                                             tmp_path: Path, dense: str) -> None:
    """Two expert-parallel ranks, the dense part replicated or FSDP2-sharded (a passed-through weight is never
    gathered): each passed-through Linear's codes and scales are read by the one rank that writes it; the export
    equals one process's byte for byte."""
    _, one, _ = model_path
    out = tmp_path / "ep2"
    results = run_ranks(2, _ep_export, str(fp8_ckpt), recipe, str(out), dense, timeout=300, env=EP_ENV)
    assert [r.exitcode for r in results] == [0, 0], [r.traceback for r in results]
    sources = {f"{n}.{p}" for n in KEPT for p in ("weight", "weight_scale_inv")}
    read = [set(r.value) & sources for r in results]
    assert read[0] and read[1] and not read[0] & read[1] and read[0] | read[1] == sources
    for r in read:  # a Linear's codes and scales together
        assert {k.rpartition(".")[0] for k in r if k.endswith(".weight")} == {k.rpartition(".")[0] for k in r
                                                                               if k.endswith("_scale_inv")}
    ours, theirs = read_export(out), read_export(one)
    assert set(ours) == set(theirs) and [k for k in sorted(ours) if not _same(ours[k], theirs[k])] == []
    for name in ("config.json", "hf_quant_config.json"):
        assert json.loads((out / name).read_text()) == json.loads((one / name).read_text()), name
