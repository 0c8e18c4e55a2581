"""The check's and the report's own inputs (issue 31): an incomplete export is never said to load, and malformed
JSON, wrong types and symlink loops are one line, exit 2 (through the one validating reader)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modelopt_k3.cli.check import main as check_main
from modelopt_k3.cli.convert import main as convert_main
from modelopt_k3.cli.report import main as report_main
from modelopt_k3.testing.qwen3_moe import make_tiny_qwen3_moe


@pytest.fixture(scope="module")
def qwen3_export(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("inputs")
    src = make_tiny_qwen3_moe(root / "src", seed=0)
    assert convert_main(["--src", str(src), "--dst", str(root / "export"), "--recipe", "presets/w4a16_nvfp4"]) == 0
    return root / "export"


def _drop(export: Path, key: str) -> None:
    index_path = export / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = export / index["weight_map"].pop(key)
    tensors = load_file(str(shard))
    del tensors[key]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


def _check(capsys, export: Path, *flags: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = check_main([str(export), "--brief", *flags])
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_complete_export_loads(qwen3_export, capsys) -> None:
    # vLLM serves the stand-in's weight-only export; SGLang refuses its 64-wide experts (w2 rows % 128,
    # issue 30): a refusal of the engine, not a missing tensor.
    rc, out, err = _check(capsys, qwen3_export, "--engine", "vllm")
    assert rc == 0 and "loads correctly" in out, out + err
    rc, out, err = _check(capsys, qwen3_export)
    assert rc == 1 and "rows % 128" in out and "does not store" not in err, out + err


@pytest.mark.parametrize("key", ["model.layers.0.mlp.gate.weight", "model.layers.1.self_attn.q_norm.weight",
                                 "model.layers.0.mlp.experts.3.up_proj.weight"],
                         ids=["router", "q_norm", "expert-projection"])
def test_an_incomplete_export_is_never_said_to_load(key, qwen3_export, tmp_path, capsys) -> None:
    export = tmp_path / "export"
    shutil.copytree(qwen3_export, export)
    _drop(export, key)
    rc, out, err = _check(capsys, export)
    assert rc == 2 and "loads correctly" not in out, out  # was: vLLM and SGLang "load correctly"
    assert err.count("\n") == 1 and f"does not store: {key}" in err, err


def _set_scale(export: Path, suffix: str, value: float) -> str:
    """Put ``value`` into the first tensor named ``...{suffix}``; returns its name."""
    index = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    key = next(k for k in sorted(index) if k.endswith(suffix))
    shard = export / index[key]
    tensors = load_file(str(shard))
    tensors[key] = torch.full_like(tensors[key], value)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return key


@pytest.mark.parametrize("value", [0.0, -0.5], ids=["zero", "negative"])
def test_a_degenerate_global_scale_is_never_said_to_load(value, qwen3_export, tmp_path, capsys) -> None:
    """A 0 (or negative) ``weight_scale_2`` loads in every engine and serves a weight of zeros (or flipped):
    the check names it and says no engine loads it (was: vLLM "loads correctly")."""
    export = tmp_path / "export"
    shutil.copytree(qwen3_export, export)
    key = _set_scale(export, ".weight_scale_2", value)
    rc, out, err = _check(capsys, export, "--engine", "vllm")
    assert rc == 2 and "loads correctly" not in out, out
    assert err.count("\n") == 1 and f"{key} = {value:g}" in err and "serves zeros or NaN" in err, err
    assert "[per-tensor-scale-degenerate]" in err  # its serving rule (docs/SERVING_RULES.md)


def _malformed(d: Path) -> None:
    (d / "config.json").write_text("{")


def _loop(d: Path) -> None:
    (d / "hf_quant_config.json").unlink()
    os.symlink("hf_quant_config.json", d / "hf_quant_config.json")


def _wrong_type(d: Path) -> None:
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": 5}))


def _duplicate_key(d: Path) -> None:
    (d / "config.json").write_text('{"model_type": "qwen3_moe", "model_type": "llama"}')


@pytest.mark.parametrize("edit", [_malformed, _loop, _wrong_type, _duplicate_key],
                         ids=["malformed", "symlink-loop", "wrong-type", "duplicate-key"])
def test_the_check_answers_bad_json_in_one_line(edit, qwen3_export, tmp_path, capsys) -> None:
    export = tmp_path / "export"
    shutil.copytree(qwen3_export, export)
    edit(export)
    rc, _, err = _check(capsys, export)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("modelopt-k3-check: error: "), err


@pytest.mark.parametrize("body", ["{", '{"schema": "modelopt_k3.quant_report", "version": 1, "modules": 5}', "[1]",
                                  "loop"], ids=["malformed", "wrong-type", "not-an-object", "symlink-loop"])
def test_the_report_answers_bad_json_in_one_line(body, tmp_path, capsys) -> None:
    path = tmp_path / "report.json"
    if body == "loop":
        os.symlink("report.json", path)
    else:
        path.write_text(body)
    capsys.readouterr()
    assert report_main([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("modelopt-k3-report: error: "), err
    assert not (tmp_path / "out").exists()
