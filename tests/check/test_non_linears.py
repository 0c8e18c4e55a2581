"""A module stored quantized that no engine builds as a quantizable Linear (a router beside its
``e_score_correction_bias``, an embedding) is refused by every engine: the scan used to leave such modules out of
the layout's Linears, so nothing looked at them and the check said "loads correctly"."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modelopt_k3.check.layout import Linear, TensorMeta, quantized_non_linears

pytestmark = pytest.mark.slow

ROUTER = "language_model.model.layers.1.block_sparse_moe.gate"


@pytest.fixture(scope="module")
def export(tiny_wide_ckpt: Path, tmp_path_factory) -> Path:
    from modelopt_k3 import convert_checkpoint
    from modelopt_k3.recipe import load_recipe

    out = tmp_path_factory.mktemp("non_linears") / "export"
    convert_checkpoint(tiny_wide_ckpt, out, load_recipe("models/moonshotai/Kimi-K3/nvfp4_experts"), workers=1)
    return out


def _store_router_as_nvfp4(export: Path) -> None:
    index_path = export / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = export / index["weight_map"][f"{ROUTER}.weight"]
    tensors = load_file(str(shard))
    rows, cols = tensors[f"{ROUTER}.weight"].shape
    tensors[f"{ROUTER}.weight"] = torch.zeros(rows, cols // 2, dtype=torch.uint8)
    tensors[f"{ROUTER}.weight_scale"] = torch.ones(rows, cols // 16).to(torch.float8_e4m3fn)
    tensors[f"{ROUTER}.weight_scale_2"] = torch.tensor(1.0)
    for key in (f"{ROUTER}.weight_scale", f"{ROUTER}.weight_scale_2"):
        index["weight_map"][key] = shard.name
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


def test_a_router_stored_as_nvfp4_is_refused_by_every_engine(export: Path, tmp_path: Path) -> None:
    from modelopt_k3.check import ENGINE_NAMES, check_export

    base = check_export(export, ENGINE_NAMES)
    assert all(not any(r.tensor.startswith(ROUTER) for r in res.refusals) for res in base.results.values())
    edited = tmp_path / "edited"
    shutil.copytree(export, edited)
    _store_router_as_nvfp4(edited)
    report = check_export(edited, ENGINE_NAMES)
    for engine, result in report.results.items():
        assert result.verdict == "refuses", engine
        assert result.refusals[0].tensor == f"{ROUTER}.weight" and "no engine builds it" in result.refusals[0].reason


def test_only_modules_outside_the_linears_are_named() -> None:
    metas = {
        "a.weight": TensorMeta(torch.uint8, (4, 8)), "a.weight_scale": TensorMeta(torch.float8_e4m3fn, (4, 1)),
        "r.weight": TensorMeta(torch.uint8, (4, 8)), "r.e_score_correction_bias": TensorMeta(torch.float32, (4,)),
        "e.weight": TensorMeta(torch.float8_e4m3fn, (10, 4)), "n.weight": TensorMeta(torch.bfloat16, (4,)),
        "p.weight_scale_2": TensorMeta(torch.float32, ()),
    }
    linears = {"a": Linear("a", {"weight": metas["a.weight"], "weight_scale": metas["a.weight_scale"]})}
    assert quantized_non_linears(metas, linears) == ("e", "p", "r")
