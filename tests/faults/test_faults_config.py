"""Config fields and arguments: every config field the tools read is checked up front and named; the converter
checks the dense shapes config.json fixes; calibration size, tokenizer and dataset are refused in the preflight
with the flag or the path; every output file has one mode.
"""

from __future__ import annotations

import re
import stat
import time
from pathlib import Path

import pytest
import torch

from faults.helpers import MIRROR, SMALL, temp_leftovers, tree_digest
from modelopt_k3.files.paths import output_mode

BUDGET_S = 5.0


def _text(**edits):
    def edit(config: dict) -> None:
        text = config.get("text_config", config)
        for key, value in edits.items():
            if value is None:
                text.pop(key, None)
            else:
                text[key] = value

    return edit


def _one_line(err: str, prog: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and "Traceback" not in err, err
    return lines[0]


def _run(run_tool, tool: str, src: Path, out: Path, *extra) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    if tool == "convert":
        rc, _, err = run_tool("convert", ["--src", src, "--dst", out, "--recipe", MIRROR, "--no_progress", *extra])
        prog = "modelopt-k3-convert"
    else:
        rc, _, err = run_tool("ptq", ["--pyt_ckpt_path", src, "--trust_remote_code", "--export_path", out, *SMALL,
                                      *extra])
        prog = "modelopt-k3-ptq"
    seconds = time.perf_counter() - t0
    return rc, _one_line(err, prog) if rc else err, seconds


@pytest.mark.parametrize("tool", ["convert", "ptq"])
@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "v_head_dim"])
def test_a_missing_config_field_is_one_line_naming_it(field, tool, copy_ckpt, tmp_path, run_tool) -> None:
    src = copy_ckpt(edit_config=_text(**{field: None}))
    before = tree_digest(src)
    out = tmp_path / "out"
    rc, line, seconds = _run(run_tool, tool, src, out)
    assert rc == 2 and seconds < BUDGET_S
    assert f"config.json text_config.{field} = None; a positive integer is needed" in line, line
    assert tree_digest(src) == before and not out.exists() and temp_leftovers(out) == []


@pytest.mark.parametrize("edit, message", [
    (_text(vocab_size=1024), r"embed_tokens\.weight stored as \[512, 128\], config\.json needs \[1024, 128\] "
                             r"\(vocab_size x hidden_size\)"),
    (_text(intermediate_size=128), r"layers\.0\.mlp\.\w+_proj\.weight stored as \[\d+, \d+\], config\.json needs"),
], ids=["vocab_size", "intermediate_size"])
def test_the_converter_checks_dense_shapes_against_the_config(edit, message, copy_ckpt, tmp_path, run_tool) -> None:
    """Without --trust_remote_code (no model is built): before, these were checked against the headers only."""
    src = copy_ckpt(edit_config=edit)
    rc, line, seconds = _run(run_tool, "convert", src, tmp_path / "out")
    assert rc == 2 and seconds < BUDGET_S
    assert re.search(rf"dense tensors do not match config\.json: .*{message}", line), line


@pytest.mark.parametrize("case", ["calib_size", "no tokenizer", "non-UTF-8 dataset"])
def test_hf_ptq_refuses_calibration_inputs_in_the_preflight(case, copy_ckpt, tiny_ckpt, tmp_path, run_tool) -> None:
    src, extra = tiny_ckpt, []
    if case == "calib_size":
        extra = ["--calib_size", "100000000"]
        want = r"--calib_size 100000000 .* tokens need \d+\.\d GiB for their ids alone"
    elif case == "no tokenizer":
        src = copy_ckpt()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (src / name).unlink()
        want = rf"{re.escape(str(src))} has no tokenizer \(none of tokenizer_config\.json"
    else:
        data = tmp_path / "calib.txt"
        data.write_bytes(b"some text\n\xff\xfe not utf-8\n")
        extra = ["--dataset", str(data)]
        want = rf"calibration file {re.escape(str(data))} is not UTF-8 text \(byte 10"
    out = tmp_path / "out"
    t0 = time.perf_counter()
    rc, _, err = run_tool("ptq", ["--pyt_ckpt_path", src, "--trust_remote_code", "--export_path", out, *SMALL,
                                  *extra])  # a flag given twice: the later one wins
    assert time.perf_counter() - t0 < BUDGET_S
    line = _one_line(err, "modelopt-k3-ptq")
    assert rc == 2 and re.search(want, line), line
    assert not out.exists() and temp_leftovers(out) == []


def test_every_output_file_has_one_mode(tiny_ckpt, tmp_path, run_tool) -> None:
    """safetensors' save_file makes its file 0600; every other file gets 0666 less the umask."""
    from modelopt_k3.export.writer import PlannedShard, PlannedTensor, ShardWriter, write_json_atomic

    (tmp_path / "w").mkdir()
    with ShardWriter(tmp_path / "w") as w:
        w.add("x", torch.zeros(4))
    write_json_atomic(tmp_path / "w" / "a.json", {})
    PlannedShard(tmp_path / "w" / "p.safetensors", [PlannedTensor("x", torch.float32, (2,))]).close()
    out = tmp_path / "converted"
    assert run_tool("convert", ["--src", tiny_ckpt, "--dst", out, "--recipe", MIRROR, "--no_progress"])[0] == 0
    files = [p for d in (tmp_path / "w", out) for p in d.iterdir() if p.is_file()]
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {oct(output_mode())}, modes
