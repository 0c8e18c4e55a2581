"""Broken source checkpoints: each is refused by the converter and by hf_ptq, naming the tensor or file,
before anything is written, with exit code 2 and one line; the source stays byte-identical and no
temporary data is left.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from faults.helpers import LAYERS, MIRROR, SMALL, export_is_complete, temp_leftovers, tree_digest
from modelopt_k3.testing.reference import read_checkpoint

INDEX = "model.safetensors.index.json"
EXPERT = f"{LAYERS}.2.block_sparse_moe.experts.5"
QUANTIZED = f"{LAYERS}.0.self_attn.q_proj.weight"  # fp8_pb in the mirror recipe (the nvfp4 preset keeps attention BF16)
KEPT = "language_model.lm_head.weight"  # left BF16 by every recipe: copied unchanged
SCALE = f"{LAYERS}.3.block_sparse_moe.experts.6.w1.weight_scale"


def _shard(ckpt: Path, i: int) -> Path:
    return ckpt / sorted(set(json.loads((ckpt / INDEX).read_text())["weight_map"].values()))[i]


def _corrupt_header(make, tiny: Path) -> Path:
    path = make()
    shard = _shard(path, 1)
    data = bytearray(shard.read_bytes())
    data[8:24] = b"\xff" * 16  # the JSON header now starts with bytes that are not UTF-8
    shard.write_bytes(bytes(data))
    return path


def _truncate(make, tiny: Path) -> Path:
    path = make()
    shard = _shard(path, 2)
    shard.write_bytes(shard.read_bytes()[:-1000])
    return path


def _with(tiny: Path, key: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    with safe_open(tiny / json.loads((tiny / INDEX).read_text())["weight_map"][key], framework="pt") as f:
        return {key: edit(f.get_tensor(key).clone())}


def _nan_at(t: torch.Tensor) -> torch.Tensor:
    t.view(-1)[7] = float("nan")
    return t


def _e8m0_nan(t: torch.Tensor) -> torch.Tensor:
    t.view(-1)[3] = 255
    return t


def _edit_text_config(**fields):
    def edit(config: dict) -> None:
        config["text_config"].update(fields)

    return edit


@dataclass(frozen=True)
class Case:
    build: Callable[[Callable, Path], Path]
    message: str  # regex that both tools' one-line error must match (the tensor / file and the cause)


EXPERT_TENSORS = [f"{EXPERT}.{p}.{t}" for p in ("w1", "w2", "w3") for t in ("weight_packed", "weight_scale")]
CASES = {
    "corrupt-header": Case(_corrupt_header, r"model-00002-of-00004\.safetensors has a corrupt safetensors header"),
    "truncated-shard": Case(_truncate, r"model-00003-of-00004\.safetensors is truncated"),
    "expert-removed": Case(
        lambda make, tiny: make(drop=EXPERT_TENSORS),
        rf"routed experts do not match config\.json: 6 missing: {re.escape(EXPERT)}\.w1\.weight_packed",
    ),
    "projection-pair-removed": Case(
        lambda make, tiny: make(drop=[f"{EXPERT}.w3.weight_packed", f"{EXPERT}.w3.weight_scale"]),
        rf"2 missing: {re.escape(EXPERT)}\.w3\.weight_packed, {re.escape(EXPERT)}\.w3\.weight_scale",
    ),
    "expert-reshaped": Case(
        lambda make, tiny: make(replace=_with(tiny, f"{EXPERT}.w2.weight_packed", lambda t: t[:, :16].contiguous())),
        rf"1 mis-shaped: {re.escape(EXPERT)}\.w2\.weight_packed stored as torch\.uint8 \[64, 16\], config needs "
        r"torch\.uint8 \[64, 32\]",
    ),
    "config-shapes-disagree": Case(
        lambda make, tiny: make(edit_config=_edit_text_config(moe_intermediate_size=32)),
        r"mis-shaped: .*config needs .*moe_intermediate_size=32",
    ),
    "config-more-experts": Case(
        lambda make, tiny: make(edit_config=_edit_text_config(num_experts=16)),
        rf"num_experts=16 but every MoE layer stores experts 0-7.*missing: {re.escape(LAYERS)}\.1\.block_sparse_moe\.experts\.8\.",
    ),
    "config-fewer-experts": Case(
        lambda make, tiny: make(edit_config=_edit_text_config(num_experts=4)),
        r"unexpected: .*experts\.4\.w1\.weight_packed \(expert 4 >= num_experts=4\)",
    ),
    "config-not-json": Case(
        lambda make, tiny: make(edit_files={"config.json": lambda text: text[: len(text) // 2]}),
        r"config\.json is not valid JSON",
    ),
    "nan-in-quantized-weight": Case(
        lambda make, tiny: make(replace=_with(tiny, QUANTIZED, _nan_at)),
        rf"values that are not numbers in 1 tensor\(s\): {re.escape(QUANTIZED)} \(1 NaN/Inf value\)",
    ),
    "nan-in-kept-weight": Case(
        lambda make, tiny: make(replace=_with(tiny, KEPT, _nan_at)),
        rf"{re.escape(KEPT)} \(1 NaN/Inf value\).*--allow_nonfinite_passthrough",
    ),
    "e8m0-nan-scale": Case(
        lambda make, tiny: make(replace=_with(tiny, SCALE, _e8m0_nan)),
        rf"{re.escape(SCALE)} \(1 E8M0 scale byte 255 \(NaN\)\)",
    ),
}


def _one_error_line(err: str, prog: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_converter_refuses(case: str, copy_ckpt, tiny_ckpt: Path, tmp_path: Path, run_tool) -> None:
    src = CASES[case].build(copy_ckpt, tiny_ckpt)
    before = tree_digest(src)
    dst = tmp_path / "converted"
    rc, _, err = run_tool("convert", ["--src", src, "--dst", dst, "--recipe", MIRROR, "--no_progress"])
    assert rc == 2
    assert re.search(CASES[case].message, _one_error_line(err, "modelopt-k3-convert")), err
    assert tree_digest(src) == before
    assert not (dst / ".modelopt_k3_complete").exists() and not (dst / INDEX).exists()
    assert temp_leftovers(dst) == []
    if not case.startswith(("nan-", "e8m0-")):  # refused by the plan: nothing was created
        assert not dst.exists()


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_hf_ptq_refuses(case: str, copy_ckpt, tiny_ckpt: Path, tmp_path: Path, run_tool) -> None:
    src = CASES[case].build(copy_ckpt, tiny_ckpt)
    before = tree_digest(src)
    out = tmp_path / "export"
    rc, _, err = run_tool("ptq", ["--pyt_ckpt_path", src, "--trust_remote_code", "--export_path", out, *SMALL])
    assert rc == 2
    assert re.search(CASES[case].message, _one_error_line(err, "modelopt-k3-ptq")), err
    assert tree_digest(src) == before
    assert not out.exists() and temp_leftovers(out) == []


@pytest.mark.slow
def test_passthrough_copies_a_kept_nan_unchanged_and_says_so(copy_ckpt, tiny_ckpt, tmp_path, run_tool, caplog) -> None:
    src = CASES["nan-in-kept-weight"].build(copy_ckpt, tiny_ckpt)
    before = tree_digest(src)
    source = read_checkpoint(src)[KEPT]
    dst, out = tmp_path / "converted", tmp_path / "export"
    rc, text, err = run_tool("convert", ["--src", src, "--dst", dst, "--recipe", MIRROR, "--no_progress",
                                         "--allow_nonfinite_passthrough"])
    assert rc == 0, err
    assert f"copied unchanged with non-finite values: {KEPT} (1 NaN/Inf value)" in text
    rc, text, err = run_tool("ptq", ["--pyt_ckpt_path", src, "--trust_remote_code", "--export_path", out, *SMALL,
                                     "--allow_nonfinite_passthrough"])
    assert rc == 0, err
    # A logging warning (stderr outside pytest, whose log capture takes it here).
    assert f"passing 1 tensor(s) with non-finite values through unchanged: {KEPT}" in caplog.text
    for written in (read_checkpoint(dst)[KEPT], read_checkpoint(out)[KEPT]):
        assert written.view(torch.int16).equal(source.view(torch.int16))  # the NaN's bits included
    assert export_is_complete(out) and tree_digest(src) == before


def test_passthrough_never_quantizes_a_nan(copy_ckpt, tiny_ckpt, tmp_path, run_tool) -> None:
    src = CASES["nan-in-quantized-weight"].build(copy_ckpt, tiny_ckpt)
    flag = ["--allow_nonfinite_passthrough"]
    rc, _, err = run_tool("convert", ["--src", src, "--dst", tmp_path / "c", "--recipe", MIRROR, "--no_progress", *flag])
    assert rc == 2 and f"{QUANTIZED} (1 NaN/Inf value)" in err and "--allow_nonfinite_passthrough" not in err
    rc, _, err = run_tool("ptq", ["--pyt_ckpt_path", src, "--trust_remote_code", "--export_path", tmp_path / "e",
                                  "--recipe", MIRROR, *SMALL, *flag])
    line = _one_error_line(err, "modelopt-k3-ptq")
    assert rc == 2 and "quantizes tensors that hold values that are not numbers" in line and QUANTIZED in line
    assert not (tmp_path / "e").exists()


@pytest.mark.slow
def test_nan_activations_are_named_not_called_missing_data(copy_ckpt, tiny_ckpt, tmp_path, run_tool) -> None:
    """A NaN embedding (kept BF16, let through) makes every activation NaN: calibration says so."""
    src = copy_ckpt(replace=_with(tiny_ckpt, "language_model.model.embed_tokens.weight",
                                  lambda t: torch.full_like(t, float("nan"))))
    out = tmp_path / "export"
    rc, _, err = run_tool("ptq", ["--pyt_ckpt_path", src, "--trust_remote_code", "--export_path", out, *SMALL,
                                  "--allow_nonfinite_passthrough"])
    line = _one_error_line([e for e in err.splitlines() if "error" in e][0] + "\n", "modelopt-k3-ptq")
    assert rc == 2 and "calibration observed values that are not numbers" in line, err
    assert "input_quantizer (input amax)" in line and "no calibration data reached" not in err
    assert not out.exists() and temp_leftovers(out) == []


@pytest.mark.parametrize("key", [f"{LAYERS}.1.block_sparse_moe.shared_experts.up_proj.weight",
                                 f"{LAYERS}.2.block_sparse_moe.gate.weight", f"{LAYERS}.3.input_layernorm.weight",
                                 f"{LAYERS}.0.mlp.down_proj.weight", f"{LAYERS}.1.self_attn.q_conv1d.weight",
                                 f"{LAYERS}.3.self_attn.kv_b_proj.weight", f"{LAYERS}.2.mlp_res_proj.weight",
                                 f"{LAYERS}.1.block_sparse_moe.routed_expert_norm.weight"],
                         ids=["shared-expert", "router", "norm", "dense-mlp", "kda-conv", "mla-kv_b", "attn-res",
                              "latent-norm"])
def test_converter_refuses_a_missing_dense_tensor_the_config_implies_without_building_the_model(
        key, copy_ckpt, tmp_path, run_tool) -> None:
    """Kimi-K3's spec declares the language model's dense keys every checkpoint of a config stores
    (``dense_required``: KDA and MLA layers, AttnRes, latent MoE): without --trust_remote_code (no model built) a
    missing one is refused as the model path refuses it (was: converted, exit 0, an export missing it)."""
    src = copy_ckpt(drop=[key])
    rc, _, err = run_tool("convert", ["--src", src, "--recipe", MIRROR, "--no_progress", "--dst", tmp_path / "out"])
    line = _one_error_line(err, "modelopt-k3-convert")
    assert rc == 2 and f"do not match config.json: 1 missing: {key}" in line, err
    assert not (tmp_path / "out").exists()


def test_converter_refuses_a_missing_vision_tensor_with_or_without_building_the_model(
        copy_ckpt, tmp_path, run_tool) -> None:
    """A vision-tower tensor removed (from shard and index): the spec declares the tower's keys too
    (``dense_required`` from vision_config), so the converter refuses it without --trust_remote_code as the
    model built on meta refuses it with (was: converted, exit 0, an export without it)."""
    key = "vision_tower.encoder.blocks.0.wo.weight"
    src = copy_ckpt(drop=[key])
    before = tree_digest(src)
    for flags in ([], ["--trust_remote_code"]):
        dst = tmp_path / f"out{len(flags)}"
        rc, _, err = run_tool("convert", ["--src", src, "--recipe", MIRROR, "--no_progress", "--dst", dst, *flags])
        line = _one_error_line(err, "modelopt-k3-convert")
        assert rc == 2 and f"do not match config.json: 1 missing: {key}" in line, err
        assert not dst.exists()
    assert tree_digest(src) == before


def _add_tensor(ckpt: Path, key: str, tensor: torch.Tensor) -> None:
    """Store one more tensor in a shard of its own, listed in the index (a key the config implies nothing of)."""
    from safetensors.torch import save_file

    save_file({key: tensor}, str(ckpt / "extra.safetensors"), metadata={"format": "pt"})
    index = json.loads((ckpt / INDEX).read_text())
    index["weight_map"][key] = "extra.safetensors"
    (ckpt / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("key", ["vision_tower.encoder.blocks.0.wqkv.bias", "model.layers.0.mlp.gate_proj.weight",
                                 f"{LAYERS}.0.self_attn.q_proj.bias"],
                         ids=["vision-bias-attn_bias-false", "another-architecture", "language-model-bias"])
def test_converter_refuses_a_stray_dense_tensor_without_building_the_model(key, copy_ckpt, tmp_path, run_tool) -> None:
    """Kimi-K3's declared dense keys are exact (``dense_exact``): a stored tensor the config implies nothing of
    is refused without --trust_remote_code, naming it, as the model path refuses it (was: copied into the
    export)."""
    src = copy_ckpt()
    _add_tensor(src, key, torch.zeros(4, dtype=torch.bfloat16))
    rc, _, err = run_tool("convert", ["--src", src, "--recipe", MIRROR, "--no_progress", "--dst", tmp_path / "out"])
    line = _one_error_line(err, "modelopt-k3-convert")
    assert rc == 2 and f"1 unexpected: {key} (config.json implies no such tensor)" in line, err
    assert not (tmp_path / "out").exists()


def test_converter_says_what_it_did_not_check_only_when_it_did_not_build_the_model(copy_ckpt, tmp_path, run_tool) -> None:
    argv = ["--src", copy_ckpt(), "--recipe", MIRROR, "--no_progress"]
    rc, text, err = run_tool("convert", [*argv, "--dst", tmp_path / "unchecked"])
    assert rc == 0 and "dense tensors were checked against config.json only" in text, err
    rc, text, err = run_tool("convert", [*argv, "--dst", tmp_path / "trusted", "--trust_remote_code"])
    assert rc == 0 and "checked against config.json only" not in text, err


# --------------------------------------------------------------------------- a source changed between a run and its resume


def _flip_low_bit(ckpt: Path, file: str, *, keep_mtime: bool, key: str | None = None) -> str:
    """Flip the lowest bit of one floating tensor of ``file`` (``key``, else the first bf16 one; header and
    size unchanged, still finite); return its name. ``keep_mtime``: put the modification time back, so only
    the bytes tell."""
    from modelopt_k3.checkpoint import CheckpointReader

    with CheckpointReader(ckpt) as reader:
        key, info = next((k, i) for k, i in reader.headers().items() if i.file == file and (
            k == key if key is not None else i.dtype == torch.bfloat16))
    path = ckpt / file
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(info.offset)
        byte = f.read(1)[0]
        f.seek(info.offset)
        f.write(bytes([byte ^ 1]))
    if keep_mtime:
        import os

        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return key


@pytest.mark.parametrize("keep_mtime", [True, False], ids=["same-mtime", "new-mtime"])
def test_a_source_changed_before_the_resume_is_refused_never_mixed(keep_mtime, copy_ckpt, tmp_path, run_tool) -> None:
    """Rank 0 of 2 converted its shards, then a shard it read changed (same header and size; even its mtime
    put back): its resume re-hashes what each kept shard was made from and refuses; rank 1's finalize
    re-hashes what changed by size, times or inode (the ctime always moves) and refuses too; --overwrite
    converts everything from the current source."""
    import time

    from modelopt_k3.convert import convert_checkpoint

    src = copy_ckpt()
    dst = tmp_path / "out"
    convert_checkpoint(src, dst, MIRROR, rank=0, world_size=2)
    files = sorted(set(json.loads((src / INDEX).read_text())["weight_map"].values()))
    key = _flip_low_bit(src, files[0], keep_mtime=keep_mtime)  # files[0] is rank 0's
    before = tree_digest(src)
    args = ["--src", src, "--dst", dst, "--recipe", MIRROR, "--no_progress", "--world_size", "2"]
    t0 = time.perf_counter()
    rc, _, err = run_tool("convert", [*args, "--rank", "0"])
    assert rc == 2 and time.perf_counter() - t0 < 5.0
    line = _one_error_line(err, "modelopt-k3-convert")
    assert re.search(rf"the source changed since output shard {re.escape(files[0])} was converted \(tensor "
                     rf"{re.escape(key)} no longer holds the bytes", line), line
    rc, _, err = run_tool("convert", [*args, "--rank", "1"])  # converts its own shards, then cannot finalize
    assert rc == 2 and re.search(rf"output shard {re.escape(files[0])} was converted \(tensor {re.escape(key)} ",
                                 _one_error_line(err, "modelopt-k3-convert"))
    assert not (dst / ".modelopt_k3_complete").exists() and not (dst / INDEX).exists()
    assert tree_digest(src) == before and temp_leftovers(dst) == []
    for rank in (0, 1):
        assert run_tool("convert", [*args, "--rank", str(rank), "--overwrite"])[0] == 0
    fresh = tmp_path / "fresh"
    convert_checkpoint(src, fresh, MIRROR)
    assert tree_digest(dst)[files[0]] == tree_digest(fresh)[files[0]]


def test_the_shard_record_holds_the_digest_of_every_tensor_its_quantized_jobs_read(copy_ckpt, tmp_path, run_tool):
    """The completion record keeps the sha256 of what the quantized jobs read, not only of copied tensors:
    every source tensor of the shard is in ``source.read`` with its digest, and a resume after one bit of a
    quantized job's weight changed (mtime put back) is refused naming that tensor."""
    import hashlib

    from modelopt_k3.checkpoint import CheckpointReader
    from modelopt_k3.convert import convert_checkpoint
    from modelopt_k3.convert.plan import _build_plan
    from modelopt_k3.recipe import load_recipe

    src = copy_ckpt()
    dst = tmp_path / "out"
    convert_checkpoint(src, dst, MIRROR, rank=0, world_size=2)
    files = sorted(set(json.loads((src / INDEX).read_text())["weight_map"].values()))
    rec = json.loads((dst / ".modelopt_k3_convert" / "shards" / f"{files[0]}.json").read_text())
    plan = _build_plan(src, load_recipe(MIRROR))
    try:
        jobs = plan.jobs[files[0]]
        quantized = sorted({s for j in jobs if not isinstance(j, str) and j.kind == "quant" for s in j.sources})
        copied = {j for j in jobs if isinstance(j, str)}
    finally:
        plan.reader.close()
    assert quantized and copied and not set(quantized) & copied
    with CheckpointReader(src) as reader:
        infos = {k: i for k, i in reader.headers().items() if i.file == files[0]}
    raw = (src / files[0]).read_bytes()  # the digests from the file's bytes, not through the reader
    digest = {k: hashlib.sha256(raw[infos[k].offset : infos[k].offset + infos[k].nbytes]).hexdigest()
              for k in quantized}
    own = set(infos)
    assert own <= set(rec["source"]["read"])
    assert {k: rec["source"]["read"][k] for k in quantized} == digest
    key = _flip_low_bit(src, files[0], keep_mtime=True, key=quantized[0])
    rc, _, err = run_tool("convert", ["--src", src, "--dst", dst, "--recipe", MIRROR, "--no_progress",
                                      "--world_size", "2", "--rank", "0"])
    assert rc == 2 and re.search(rf"output shard {re.escape(files[0])} was converted \(tensor {re.escape(key)} ",
                                 _one_error_line(err, "modelopt-k3-convert"))
