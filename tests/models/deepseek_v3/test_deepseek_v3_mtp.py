"""DeepSeek-V3 MTP layers (``num_nextn_predict_layers``: ``model.layers.{num_hidden_layers}``, which transformers does
not build): accepted, carried into the export unquantized on the model path and the converter alike (a block-FP8 or
INT4 weight decoded BF16, as ModelOpt's DeepSeek converter writes them, everything else as stored), listed in the
exclusions (``model.layers.3*``, ModelOpt's ``layers.61*``), and checked tensor by tensor against config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _exports import read_export
from safetensors import safe_open
from safetensors.torch import save_file

import modelopt_k3
from modelopt_k3.check import check_export
from modelopt_k3.check.report import LOADS, REFUSES
from modelopt_k3.checkpoint.source_check import SourceMismatchError
from modelopt_k3.convert import convert_checkpoint
from modelopt_k3.numerics import block_fp8_decode, int4_packed_decode
from modelopt_k3.spec import SpecError
from modelopt_k3.testing.deepseek_v3 import make_tiny_deepseek_v3

from .conftest import W4A16, quantize_and_export, weight_only_export

INDEX = "model.safetensors.index.json"
MTP = "model.layers.3"
ENGINES = ("vllm", "sglang", "trtllm")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:10]
    return sorted(k for k in a if not _same(a[k], b[k]))


def _expected_mtp(src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MTP tensors an export must hold, from the source by the independent decoders: block-FP8 weights decoded
    with the declared 128x128 block, INT4 experts with group 32, both BF16; everything else as stored."""
    out: dict[str, torch.Tensor] = {}
    for key, t in src.items():
        if not key.startswith(f"{MTP}."):
            continue
        head, _, part = key.rpartition(".")
        if part == "weight" and t.dtype == torch.float8_e4m3fn:
            out[key] = block_fp8_decode(t, src[f"{head}.weight_scale_inv"], (128, 128), torch.bfloat16)
        elif part == "weight_packed":
            scale = src[f"{head}.weight_scale"]
            out[f"{head}.weight"] = int4_packed_decode(t, scale, scale.shape[-1] * 32, 32, torch.bfloat16)
        elif part not in ("weight_scale_inv", "weight_scale", "weight_shape"):
            out[key] = t
    return out


@pytest.fixture(scope="module")
def mtp_exports(deepseek_mtp_ckpts: dict[str, Path], tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """source -> (converter output, model-path export) of the MTP stand-in, weight-only recipe."""
    out = {}
    for source, ckpt in deepseek_mtp_ckpts.items():
        root = tmp_path_factory.mktemp(f"deepseek_v3_mtp_{source}")
        convert_checkpoint(ckpt, root / "converted", W4A16)
        out[source] = root / "converted", weight_only_export(ckpt, root / "model_path")
    return out


@pytest.mark.parametrize("source", ["block_fp8", "int4", "bf16"])
def test_mtp_layer_is_carried_unquantized_on_both_paths(source: str, deepseek_mtp_ckpts, mtp_exports,
                                                          tmp_path: Path) -> None:
    """Both paths write the same bytes; the export holds every MTP tensor (decoded BF16 where the source encodes
    it, as stored otherwise) and nothing quantized under it; the other layers are what the source without MTP
    layers exports; exclude_modules names the layer."""
    converted, model_path = mtp_exports[source]
    mine = read_export(converted)
    assert _differing(mine, read_export(model_path)) == []
    for name in ("config.json", "hf_quant_config.json"):
        assert json.loads((converted / name).read_text()) == json.loads((model_path / name).read_text())
    src = read_export(deepseek_mtp_ckpts[source])
    want = _expected_mtp(src)
    got = {k: t for k, t in mine.items() if k.startswith(f"{MTP}.")}
    assert set(got) == set(want)
    assert [k for k in want if not _same(got[k], want[k])] == []
    assert len([k for k in got if ".mlp.experts." in k]) == 8 * 3  # every routed expert Linear of the layer
    assert f"{MTP}.eh_proj.weight" in got and f"{MTP}.shared_head.head.weight" in got
    hf_quant = json.loads((converted / "hf_quant_config.json").read_text())["quantization"]
    assert f"{MTP}*" in hf_quant["exclude_modules"]
    # The decoder layers are untouched by the MTP layer: the stand-in without one converts to the same bytes.
    plain = convert_checkpoint(make_tiny_deepseek_v3(tmp_path / "plain", source=source), tmp_path / "out", W4A16).dst
    rest = {k: t for k, t in mine.items() if not k.startswith(f"{MTP}.")}
    assert _differing(rest, read_export(plain)) == []


def test_the_engines_skip_the_carried_mtp_layer(deepseek_mtp_ckpts, mtp_exports, tmp_path: Path) -> None:
    """modelopt-k3-check: vLLM (num_nextn_predict_layers > 0) and SGLang skip the MTP layer in the main model and
    say so; their drafters, replayed on it with the same configs, load it (BF16, excluded); the calibrated nvfp4
    export with an MTP layer loads on all three."""
    converted, _ = mtp_exports["block_fp8"]
    report = check_export(converted, ENGINES)
    assert {e: r.verdict for e, r in report.results.items()} == {"vllm": LOADS, "sglang": LOADS, "trtllm": REFUSES}
    for engine in ("vllm", "sglang"):
        assert any(MTP in w for w in report.results[engine].warnings), report.results[engine].details()
    calibrated = quantize_and_export(deepseek_mtp_ckpts["block_fp8"], tmp_path / "nvfp4")
    report = check_export(calibrated, ENGINES)
    assert {e: r.verdict for e, r in report.results.items()} == dict.fromkeys(ENGINES, LOADS), report.table()
    exported = read_export(calibrated)
    want = _expected_mtp(read_export(deepseek_mtp_ckpts["block_fp8"]))
    assert [k for k in want if not _same(exported[k], want[k])] == []


def _rewrite(ckpt: Path, drop: tuple[str, ...] = (), add: dict[str, torch.Tensor] | None = None,
             replace: dict[str, torch.Tensor] | None = None) -> None:
    """Drop, add (to the last shard) or replace tensors of ``ckpt``, rewriting its shards and index."""
    index = json.loads((ckpt / INDEX).read_text())
    wmap = index["weight_map"]
    files = sorted(set(wmap.values()))
    add, replace = add or {}, replace or {}
    for fname in files:
        with safe_open(ckpt / fname, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        tensors = {k: replace.get(k, t) for k, t in tensors.items() if k not in drop}
        if fname == files[-1]:
            tensors.update(add)
        save_file(tensors, str(ckpt / fname), metadata={"format": "pt"})
    wmap = {k: v for k, v in wmap.items() if k not in drop} | dict.fromkeys(add, files[-1])
    index["weight_map"] = dict(sorted(wmap.items()))
    (ckpt / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize("fault", ["missing", "missing_scale", "stray", "misshaped"])
def test_the_source_check_refuses_a_wrong_mtp_layer(fault: str, tmp_path: Path) -> None:
    """A missing, stray or mis-shaped MTP tensor (or a float8 weight without its scales) is refused by name by
    load_pretrained and the converter, before anything is written."""
    ckpt = make_tiny_deepseek_v3(tmp_path / "ckpt", num_nextn_predict_layers=1)
    name = {"missing": f"{MTP}.eh_proj.weight", "missing_scale": f"{MTP}.self_attn.o_proj.weight_scale_inv",
            "stray": f"{MTP}.extra_proj.weight", "misshaped": f"{MTP}.enorm.weight"}[fault]
    if fault in ("missing", "missing_scale"):
        _rewrite(ckpt, drop=(name,))
    elif fault == "stray":
        _rewrite(ckpt, add={name: torch.zeros(4, 4, dtype=torch.bfloat16)})
    else:
        _rewrite(ckpt, replace={name: torch.ones(128, dtype=torch.bfloat16)})
    with pytest.raises(SourceMismatchError, match=name.replace(".", r"\.")):
        modelopt_k3.load_pretrained(ckpt, progress=False)
    with pytest.raises(SourceMismatchError, match=name.replace(".", r"\.")):
        convert_checkpoint(ckpt, tmp_path / "out", W4A16)
    assert not (tmp_path / "out" / "config.json").exists()


def test_a_negative_mtp_count_is_refused(tmp_path: Path) -> None:
    ckpt = make_tiny_deepseek_v3(tmp_path / "ckpt", source="bf16")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": -1}))
    with pytest.raises(SpecError, match="num_nextn_predict_layers"):
        convert_checkpoint(ckpt, tmp_path / "out", W4A16)
