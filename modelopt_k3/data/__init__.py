"""Calibration data: local files, a ``datasets`` name when reachable, or the built-in set.

Texts are tokenized, concatenated and cut into ``seq_len``-token sequences (packing: no padding, so
every position is a real token). Each rank takes every ``world``-th sequence; ranks are given the
same number of batches (a short rank repeats its own sequences) because expert-parallel forwards
are collective. Repeating a sequence leaves ``max`` calibration unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

BUILTIN = "builtin"
BUILTIN_PATH = Path(__file__).with_name("calib_builtin.txt")


class DataError(ValueError):
    pass


# Characters of a calibration file read per token the run needs: far more than any tokenizer's average
# characters per token, so a file is read no further than the sequences can use (a 200 MB line is not one
# allocation), and at least ``MIN_READ_CHARS``.
CHARS_PER_TOKEN_READ = 64
MIN_READ_CHARS = 1 << 20


def read_budget(num_tokens: int) -> int:
    """Characters of a calibration file worth reading for ``num_tokens`` tokens (``load_texts(max_chars=)``)."""
    return max(num_tokens * CHARS_PER_TOKEN_READ, MIN_READ_CHARS)


def _read_text(path: Path, max_chars: int | None = None) -> str:
    """The file's text (universal newlines), its first ``max_chars`` characters when given."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read() if max_chars is None else f.read(max_chars)
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None


def _not_utf8(path: Path, e: UnicodeDecodeError) -> DataError:
    """The refusal naming the file's first byte that is not UTF-8 (a text reader's error counts from its chunk)."""
    import codecs

    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as found:
                return DataError(f"calibration file {path} is not UTF-8 text (byte {offset - pending + found.start}: "
                                 f"{found.reason})")
            offset += len(chunk)
    return DataError(f"calibration file {path} is not UTF-8 text ({e.reason})")


def _read_txt(path: Path, max_chars: int | None = None) -> list[str]:
    # Paragraphs (blank-line separated) are samples; a file without blank lines gives one per line. A file
    # longer than ``max_chars`` is read that far (its last sample may end there).
    text = _read_text(path, max_chars)
    parts = [p.strip() for p in text.split("\n\n")]
    if len(parts) <= 1:
        parts = [line.strip() for line in text.splitlines()]
    return [p for p in parts if p]


def _jsonl_lines(path: Path, max_chars: int | None):
    """(line number, line) of a JSON-lines file, until ``max_chars`` characters are read; a line longer than
    that is refused (a JSON object cut short is no object)."""
    total = 0
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(iter(lambda: f.readline(-1 if max_chars is None else max_chars + 1), ""), 1):
                if max_chars is not None and len(line) > max_chars:
                    raise DataError(f"{path}:{lineno}: a line longer than the {max_chars} characters this calibration "
                                    "can use (--calib_size x --calib_seq tokens); split it into several objects")
                yield lineno, line
                total += len(line)
                if max_chars is not None and total >= max_chars:
                    return
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None


def _read_jsonl(path: Path, field: str = "text", max_chars: int | None = None) -> list[str]:
    out = []
    for lineno, line in _jsonl_lines(path, max_chars):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not JSON: {e}") from None
        if not isinstance(row, dict) or not isinstance(row.get(field), str):
            raise DataError(f"{path}:{lineno}: expected an object with a string {field!r} field")
        out.append(row[field])
    return out


def _not_a_file(path: Path) -> str:
    """Why ``path`` is no file to read, truly (a directory or a FIFO is not "missing")."""
    import stat

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if stat.S_ISDIR(mode):
        return "is a directory; give a .txt or .jsonl file"
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"
    return f"is {kind}; only regular files are read"


def load_texts(dataset: str | None, *, max_chars: int | None = None) -> list[str]:
    """Calibration texts from ``dataset``: None/"builtin", a .txt/.jsonl path, or a ``datasets`` name.
    ``max_chars``: read a local file no further (``read_budget``: what the run's tokens can use)."""
    if dataset in (None, BUILTIN):
        return _read_txt(BUILTIN_PATH)
    path = Path(dataset)
    # An absolute or ./ ~/ path is a local file, never a hub name (no network lookup for a typo).
    local = path.is_absolute() or dataset.startswith((".", "~"))
    path = path.expanduser()
    if local or path.suffix in (".txt", ".jsonl", ".json") or path.exists():
        if not path.is_file():
            raise DataError(f"calibration file {path} {_not_a_file(path)}")
        texts = (_read_jsonl(path, max_chars=max_chars) if path.suffix in (".jsonl", ".json")
                 else _read_txt(path, max_chars))
    else:
        try:
            import datasets  # optional; needs network or a local cache
        except ImportError:
            raise DataError(
                f"{dataset!r} is not a local .txt/.jsonl file and the 'datasets' package is not installed; "
                f"use a local file or '{BUILTIN}'"
            ) from None
        try:
            ds = datasets.load_dataset(dataset, split="train", streaming=True)
            texts = [row["text"] for _, row in zip(range(4096), ds)]
        except Exception as e:
            raise DataError(f"could not load dataset {dataset!r} ({type(e).__name__}: {e}); "
                            f"use a local .txt/.jsonl file or '{BUILTIN}'") from None
    if not texts:
        raise DataError(f"calibration source {dataset!r} holds no text")
    return texts


def pack_sequences(tokenizer, texts: list[str], *, num_sequences: int, seq_len: int) -> torch.Tensor:
    """``[num_sequences, seq_len]`` token ids: texts tokenized, joined with EOS, cut; cycled if short."""
    eos = tokenizer.eos_token_id
    need = num_sequences * seq_len
    stream: list[int] = []
    for text in texts:
        # In bounded pieces (a 20 MB line is never one tokenizer call: GBs of offsets), and no further than needed.
        for piece in _pieces(text):
            stream += tokenizer(piece, add_special_tokens=False)["input_ids"]
            if len(stream) >= need:
                break
        if eos is not None:
            stream.append(eos)
        if len(stream) >= need:
            break
    if not stream:
        raise DataError("the tokenizer produced no tokens from the calibration texts")
    tokens = torch.tensor(stream, dtype=torch.long)
    if len(stream) < need:  # cycled in one tensor op: the request is bounded up front (preflight)
        tokens = tokens.repeat(-(-need // len(stream)))
    return tokens[:need].view(num_sequences, seq_len)


PIECE_CHARS = 1 << 16  # characters per tokenizer call


def _pieces(text: str, size: int = PIECE_CHARS):
    """``text`` in pieces of about ``size`` characters, cut after whitespace where there is some (a cut inside a
    word would tokenize it differently); a text shorter than ``size`` is one piece, tokenized as before."""
    start = 0
    while len(text) - start > size:
        cut = text.rfind(" ", start + size // 2, start + size)
        end = cut + 1 if cut >= 0 else start + size
        yield text[start:end]
        start = end
    yield text[start:]


def rank_batches(sequences: torch.Tensor, *, batch_size: int, rank: int, world_size: int) -> list[torch.Tensor]:
    """This rank's share as batches; every rank gets the same number of batches."""
    mine = sequences[rank::world_size]
    per_rank = -(-sequences.shape[0] // world_size)
    if mine.shape[0] == 0:
        mine = sequences[:1]
    if mine.shape[0] < per_rank:  # repeat own sequences: max calibration is unchanged by repeats
        reps = -(-per_rank // mine.shape[0])
        mine = mine.repeat(reps, 1)[:per_rank]
    return list(mine.split(batch_size))


def make_forward_loop(batches: list[torch.Tensor], *, device: torch.device, progress: bool = True) -> Callable[[nn.Module], None]:
    def forward_loop(model: nn.Module) -> None:
        for batch in tqdm(batches, desc="calibrate", disable=not progress, leave=False):
            model(input_ids=batch.to(device), use_cache=False)

    return forward_loop
