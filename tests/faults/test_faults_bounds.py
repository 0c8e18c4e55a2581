"""Bounded resources and true messages of hf_ptq's inputs (issue 31): every flag that scales the held token ids is
bounded in the preflight, ``--calib_seq`` beyond the model's positions is refused, a dataset that is a directory or
a FIFO is named as such, and a huge single line is tokenized in bounded pieces, no further than needed."""

from __future__ import annotations

import os
import re
import time
import tracemalloc

import pytest

from faults.helpers import SMALL, temp_leftovers
from modelopt_k3.data import PIECE_CHARS, DataError, load_texts, pack_sequences, read_budget

BUDGET_S = 5.0


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("modelopt-k3-ptq: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("case", ["report_heldout", "calib_seq beyond positions", "dataset is a directory",
                                  "dataset is a FIFO"])
def test_hf_ptq_refuses_in_the_preflight(case, tiny_ckpt, copy_ckpt, tmp_path, run_tool) -> None:
    src = tiny_ckpt
    if case == "report_heldout":  # was: a 256 GB allocation traceback after the preflight
        extra, want = ["--report_heldout", "1000000000"], r"\+ 1000000000 held out: --report_heldout/--eval_kl\) .* GiB"
    elif case == "calib_seq beyond positions":  # was: passed silently
        src = copy_ckpt(edit_config=lambda c: c.get("text_config", c).update(max_position_embeddings=8))
        extra, want = ["--calib_seq", "16"], r"--calib_seq 16 is longer than the model's max_position_embeddings = 8"
    elif case == "dataset is a directory":  # was: "does not exist"
        (tmp_path / "data.txt").mkdir()
        extra, want = ["--dataset", str(tmp_path / "data.txt")], r"data\.txt is a directory"
    else:
        os.mkfifo(tmp_path / "data.txt")
        extra, want = ["--dataset", str(tmp_path / "data.txt")], r"data\.txt is a FIFO; only regular files are read"
    out = tmp_path / "out"
    t0 = time.perf_counter()
    rc, _, err = run_tool("ptq", ["--pyt_ckpt_path", src, "--trust_remote_code", "--export_path", out, *SMALL,
                                  *extra])
    assert time.perf_counter() - t0 < BUDGET_S
    line = _one_line(err)
    assert rc == 2 and re.search(want, line), line
    assert not out.exists() and temp_leftovers(out) == []


class _CountingTokenizer:
    """One token per character; records the longest text it was given."""

    eos_token_id = 0

    def __init__(self) -> None:
        self.longest = 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        self.longest = max(self.longest, len(text))
        return {"input_ids": [ord(c) for c in text]}


def test_a_huge_single_line_is_tokenized_in_bounded_pieces_no_further_than_needed() -> None:
    line = "word " * (20 * 2**20 // 5)  # a 20 MB single line (was: one tokenizer call, 62 s and 4.1 GB)
    tok = _CountingTokenizer()
    tracemalloc.start()
    ids = pack_sequences(tok, [line], num_sequences=4, seq_len=64)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert tok.longest <= PIECE_CHARS
    assert peak < 64 * 2**20, peak
    assert ids.shape == (4, 64) and ids.flatten().tolist() == [ord(c) for c in line[:256]]


def test_a_200_mb_dataset_line_is_read_no_further_than_the_tokens_need(tmp_path) -> None:
    """A 200 MB single-line .txt (was: read whole, 8 GiB in 36 s): read up to ``read_budget`` characters, in
    bounded memory, and the texts begin as the file does."""
    path = tmp_path / "calib.txt"
    with open(path, "w") as f:
        for _ in range(200):
            f.write("word " * (2**20 // 5))
    tokens = 32 * 128
    tracemalloc.start()
    texts = load_texts(str(path), max_chars=read_budget(tokens))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 * 2**20, peak
    assert len(texts) == 1 and len(texts[0]) <= read_budget(tokens) and texts[0].startswith("word word")


def test_a_file_within_the_budget_reads_as_before(tmp_path) -> None:
    path = tmp_path / "calib.txt"
    path.write_text("first paragraph\nstill first\n\n  second  \n\n\nthird\n")
    assert load_texts(str(path), max_chars=10**6) == load_texts(str(path)) == [
        "first paragraph\nstill first", "second", "third"]
    jsonl = tmp_path / "calib.jsonl"
    jsonl.write_text('{"text": "a"}\n\n{"text": "b"}\n')
    assert load_texts(str(jsonl), max_chars=10**6) == load_texts(str(jsonl)) == ["a", "b"]


def test_jsonl_reading_stops_at_the_budget_and_refuses_a_longer_line(tmp_path) -> None:
    jsonl = tmp_path / "calib.jsonl"
    jsonl.write_text("".join(f'{{"text": "row {i}"}}\n' for i in range(1000)))
    # 18 characters a line: the line that crosses 40 is read whole, then reading stops
    assert load_texts(str(jsonl), max_chars=40) == ["row 0", "row 1", "row 2"]
    jsonl.write_text('{"text": "' + "x" * 100 + '"}\n')
    with pytest.raises(DataError, match=r"calib\.jsonl:1: a line longer than the 50 characters"):
        load_texts(str(jsonl), max_chars=50)


def test_a_non_utf8_byte_past_the_first_chunk_is_named_by_its_file_offset(tmp_path) -> None:
    path = tmp_path / "calib.txt"
    path.write_bytes(b"a" * 100_000 + b"\xff" + b"b" * 10)
    with pytest.raises(DataError, match=r"is not UTF-8 text \(byte 100000: invalid start byte\)"):
        load_texts(str(path))


def test_short_texts_are_tokenized_whole_as_before() -> None:
    tok = _CountingTokenizer()
    ids = pack_sequences(tok, ["ab", "cd"], num_sequences=2, seq_len=4)
    assert ids.tolist() == [[97, 98, 0, 99], [100, 0, 97, 98]]


def test_an_odd_expert_count_suggests_only_degrees_dividing_the_world_size() -> None:
    """num_experts=6 on 4 ranks, --ep_degree 4: was "one of [1, 2, 3, 6]" (3 and 6 do not divide 4)."""
    import torch

    from modelopt_k3.dist.plan import PlanError, _expert_parallel_choice

    with pytest.raises(PlanError, match=r"degree 4; with world size 4 choose a degree that divides both: one of \[1, 2\]"):
        _expert_parallel_choice(6, 0, 4, 4, None, "replicated", torch.device("cpu"), None)


def test_temporary_data_is_called_removed_only_when_it_was(tmp_path, capsys) -> None:
    """A signal that arrives as rank 0 made its staging directory, before any ``finally`` owned it: was "temporary
    data removed" with the directory left behind."""
    from modelopt_k3.cli._common import EXIT_TERMINATED, Terminated, run_cli
    from modelopt_k3.export.staging import StagingDir

    made: list[StagingDir] = []

    def make(kind: str, exc: BaseException):
        def body() -> int:
            made.append(StagingDir(tmp_path / "export", kind))
            made[-1].mkdir()
            raise exc
        return body

    assert run_cli("prog", make("tmp", Terminated(EXIT_TERMINATED))) == EXIT_TERMINATED
    err = capsys.readouterr().err
    assert "terminated (SIGTERM); temporary data removed" in err and not made[0].path.exists(), err
    run_cli("prog", make("old", KeyboardInterrupt()))  # a moved-aside export: the user's, never removed here
    err = capsys.readouterr().err
    assert f"temporary data left at {made[1].path}" in err and made[1].path.is_dir(), err
    made[1].discard()
