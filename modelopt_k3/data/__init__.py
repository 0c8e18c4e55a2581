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


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"calibration file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def _read_txt(path: Path) -> list[str]:
    # Paragraphs (blank-line separated) are samples; a file without blank lines gives one per line.
    text = _read_text(path)
    parts = [p.strip() for p in text.split("\n\n")]
    if len(parts) <= 1:
        parts = [line.strip() for line in text.splitlines()]
    return [p for p in parts if p]


def _read_jsonl(path: Path, field: str = "text") -> list[str]:
    out = []
    for lineno, line in enumerate(_read_text(path).splitlines(), 1):
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


def load_texts(dataset: str | None) -> list[str]:
    """Calibration texts from ``dataset``: None/"builtin", a .txt/.jsonl path, or a ``datasets`` name."""
    if dataset in (None, BUILTIN):
        return _read_txt(BUILTIN_PATH)
    path = Path(dataset)
    # An absolute or ./ ~/ path is a local file, never a hub name (no network lookup for a typo).
    local = path.is_absolute() or dataset.startswith((".", "~"))
    path = path.expanduser()
    if local or path.suffix in (".txt", ".jsonl", ".json") or path.exists():
        if not path.is_file():
            raise DataError(f"calibration file {path} {_not_a_file(path)}")
        texts = _read_jsonl(path) if path.suffix in (".jsonl", ".json") else _read_txt(path)
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
