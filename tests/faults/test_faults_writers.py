"""One way to write a file (issue 31): every name each writer uses, planted as a link to the source's config.json.

Writers: the report (``hf_ptq --report DIR``, ``modelopt-k3-report X --out DIR``, ``write_report``), the export's
``ShardWriter`` (shards and spill files). Each file is created new and renamed into place, never through a link,
never over a file we did not record writing, never into a checkpoint directory; the source stays byte-identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modelopt_k3.export.writer import ShardWriter
from modelopt_k3.files.paths import OWNED_RECORD, DestinationError, write_owned
from modelopt_k3.report import REPORT_FILES
from modelopt_k3.testing.qwen3_moe import make_tiny_qwen3_moe

from .helpers import tree_digest

NAMES = (*REPORT_FILES, OWNED_RECORD)
MINIMAL_REPORT = {"schema": "modelopt_k3.quant_report", "version": 1}


@pytest.fixture(scope="module")
def qwen3_src(tmp_path_factory) -> Path:
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("writers") / "src", seed=0)


def _plant(dest: Path, names, target: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        (dest / name).symlink_to(target)


@pytest.mark.parametrize("name", NAMES)
def test_write_owned_never_writes_through_a_planted_link(name, qwen3_src, tmp_path) -> None:
    before = tree_digest(qwen3_src)
    out = tmp_path / "report"
    _plant(out, [name], qwen3_src / "config.json")
    with pytest.raises(DestinationError, match="symlink"):
        write_owned(out, {n: b"x" for n in REPORT_FILES}, flag="--report")
    assert tree_digest(qwen3_src) == before
    assert (out / name).is_symlink() and sorted(p.name for p in out.iterdir()) == [name]


def test_write_owned_replaces_only_what_it_recorded(tmp_path) -> None:
    out = tmp_path / "report"
    write_owned(out, {"report.md": b"one"}, flag="--report")
    write_owned(out, {"report.md": b"two"}, flag="--report")  # ours: replaced
    assert (out / "report.md").read_bytes() == b"two"
    (out / "report.md").write_bytes(b"the user's edit")
    with pytest.raises(DestinationError, match="not what this tool wrote"):
        write_owned(out, {"report.md": b"three"}, flag="--report")
    (out / "notes.md").write_text("mine")
    with pytest.raises(DestinationError, match="not what this tool wrote"):
        write_owned(out, {"notes.md": b"x"}, flag="--report")
    assert (out / "report.md").read_bytes() == b"the user's edit" and (out / "notes.md").read_text() == "mine"


def test_write_owned_never_writes_into_a_checkpoint(qwen3_src) -> None:
    before = tree_digest(qwen3_src)
    with pytest.raises(DestinationError, match="is a checkpoint directory"):
        write_owned(qwen3_src, {"report.md": b"x"}, flag="--out")
    assert tree_digest(qwen3_src) == before


def _ptq(run_tool, src: Path, export: Path, *extra) -> tuple[int, str]:
    rc, _, err = run_tool("ptq", ["--pyt_ckpt_path", src, "--export_path", export, "--calib_size", "2",
                                  "--calib_seq", "16", "--no_progress", *extra])
    return rc, err


@pytest.mark.slow
def test_hf_ptq_report_refuses_planted_links_before_any_weight_is_read(qwen3_src, tmp_path, run_tool) -> None:
    before = tree_digest(qwen3_src)
    report = tmp_path / "report"
    _plant(report, NAMES, qwen3_src / "config.json")
    rc, err = _ptq(run_tool, qwen3_src, tmp_path / "export", "--report", report)
    assert rc == 2 and "is a symlink" in err and "Traceback" not in err, err
    assert tree_digest(qwen3_src) == before
    assert not (tmp_path / "export").exists()  # refused before the export, not after it


@pytest.mark.slow
@pytest.mark.parametrize("case", ["existing file", "another checkpoint", "the export itself"])
def test_hf_ptq_report_destination_is_checked_before_the_export(case, qwen3_src, tmp_path, run_tool) -> None:
    export = tmp_path / "export"
    if case == "existing file":
        report = tmp_path / "report.txt"
        report.write_text("mine")
    elif case == "another checkpoint":
        report = tmp_path / "other"
        report.mkdir()
        (report / "config.json").write_text("{}")
        (report / "model.safetensors").write_bytes(b"")
    else:
        report = export
    rc, err = _ptq(run_tool, qwen3_src, export, "--report", report)
    assert rc == 2 and "--report" in err and "Traceback" not in err, err
    assert not export.exists()


@pytest.mark.parametrize("name", ["report.md", "error_by_layer.png", "expert_tokens.png", "worst_modules.png",
                                  OWNED_RECORD])
def test_report_cli_out_refuses_a_planted_link(name, qwen3_src, tmp_path, capsys) -> None:
    from modelopt_k3.cli.report import main

    before = tree_digest(qwen3_src)
    src = tmp_path / "r" / "report.json"
    src.parent.mkdir()
    src.write_text(json.dumps(MINIMAL_REPORT))
    out = tmp_path / "out"
    _plant(out, [name], qwen3_src / "config.json")
    assert main([str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "symlink" in err, err
    assert tree_digest(qwen3_src) == before


def test_report_cli_out_refuses_a_checkpoint_directory(qwen3_src, tmp_path, capsys) -> None:
    from modelopt_k3.cli.report import main

    before = tree_digest(qwen3_src)
    src = tmp_path / "report.json"
    src.write_text(json.dumps(MINIMAL_REPORT))
    assert main([str(src), "--out", str(qwen3_src)]) == 2
    assert "is a checkpoint directory" in capsys.readouterr().err
    assert tree_digest(qwen3_src) == before


@pytest.mark.parametrize("spill", [False, True], ids=["save", "spill"])
def test_shard_writer_never_writes_through_a_planted_link(spill, qwen3_src, tmp_path) -> None:
    before = tree_digest(qwen3_src)
    out = tmp_path / "shards"
    name = "model-r00000-00000.safetensors"
    _plant(out, [f".{name}.spill" if spill else name], qwen3_src / "config.json")
    with pytest.raises(FileExistsError), ShardWriter(out, spill_bytes=0 if spill else 2**30) as writer:
        writer.add("a", torch.ones(8))
        writer.add("b", torch.ones(8))
    assert tree_digest(qwen3_src) == before
