"""The one safetensors reader (``modelopt_k3.checkpoint``): every header fault either old reader refused
(the loader's ``CheckpointReader`` and the converter's former ``_scan_source``) is refused at
construction, naming the file and the tensor, before a tensor byte is read; both read modes
(``safe_open`` and ``pread``) return the stored bytes and record what they read.

Fast: a two-shard checkpoint of a few tensors written here, no model.
"""

from __future__ import annotations

import ast
import json
import re
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from modelopt_k3.checkpoint import INDEX_NAME, SINGLE_NAME, CheckpointError, CheckpointReader, read_header

PACKAGE = Path(__file__).resolve().parents[1] / "modelopt_k3"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
TENSORS = {
    SHARDS[0]: {
        "a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "a.bias": torch.tensor([1.5, float("nan")], dtype=torch.bfloat16),
    },
    SHARDS[1]: {
        "b.weight_packed": torch.arange(8, dtype=torch.uint8).reshape(2, 4),
        "b.weight_scale": torch.tensor([[127], [255]], dtype=torch.uint8),  # 255: E8M0 NaN
    },
}


def _write(path: Path, single: bool = False) -> Path:
    path.mkdir()
    if single:
        save_file({k: v for t in TENSORS.values() for k, v in t.items()}, str(path / SINGLE_NAME),
                  metadata={"format": "pt"})
        return path
    weight_map = {}
    for file, tensors in TENSORS.items():
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _header(path: Path) -> tuple[int, dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _rewrite_header(path: Path, edit: Callable[[dict], None]) -> None:
    """Edit shard ``path``'s JSON header in place; the data bytes stay where they are."""
    n, header, data = _header(path)
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _edit_index(ckpt: Path, edit: Callable[[dict], None]) -> None:
    index = json.loads((ckpt / INDEX_NAME).read_text())
    edit(index["weight_map"])
    (ckpt / INDEX_NAME).write_text(json.dumps(index))


def _set(key: str, field: str, value) -> Callable[[dict], None]:
    def edit(header: dict) -> None:
        header[key][field] = value

    return edit


# Each fault: (how to break the checkpoint, regex the one error must match). The shard file and the
# tensor are named whenever the fault has one.
S0, S1 = (re.escape(s) for s in SHARDS)
FAULTS: dict[str, tuple[Callable[[Path], None], str]] = {
    "missing-shard": (lambda c: (c / SHARDS[1]).unlink(), rf"checkpoint shard .*{S1} is missing"),
    "header-not-utf8": (
        lambda c: (c / SHARDS[0]).write_bytes(
            (c / SHARDS[0]).read_bytes()[:8] + b"\xff" * 16 + (c / SHARDS[0]).read_bytes()[24:]),
        rf"{S0} has a corrupt safetensors header",
    ),
    "shorter-than-length-prefix": (lambda c: (c / SHARDS[0]).write_bytes(b"\x01\x02"),
                                   rf"{S0} has a corrupt safetensors header"),
    "header-length-past-the-end": (
        lambda c: (c / SHARDS[0]).write_bytes(struct.pack("<Q", 10**12) + (c / SHARDS[0]).read_bytes()[8:]),
        rf"{S0} has a corrupt safetensors header: the header claims 1000000000000 bytes",
    ),
    "header-not-an-object": (
        lambda c: (c / SHARDS[0]).write_bytes(struct.pack("<Q", 8) + b"[1,2,3] "),
        rf"{S0} has a corrupt safetensors header: not a JSON object",
    ),
    "truncated-data": (
        lambda c: (c / SHARDS[1]).write_bytes((c / SHARDS[1]).read_bytes()[:-3]),
        rf"{S1} is truncated: tensor b\.weight_\w+ ends at byte \d+ but the file has \d+ bytes",
    ),
    "offsets-do-not-span-the-shape": (
        lambda c: _rewrite_header(c / SHARDS[0], _set("a.weight", "shape", [3, 2])),
        rf"{S0}: header/size mismatch for tensor a\.weight: F32 \[3, 2\] is 24 bytes but its data_offsets",
    ),
    "negative-offset": (
        lambda c: _rewrite_header(c / SHARDS[1], _set("b.weight_packed", "data_offsets", [-2, 6])),
        rf"{S1}: header/size mismatch for tensor b\.weight_packed",
    ),
    "unsupported-dtype": (
        lambda c: _rewrite_header(c / SHARDS[1], _set("b.weight_scale", "dtype", "F4")),
        rf"{S1}: tensor b\.weight_scale has unsupported dtype 'F4'",
    ),
    "entry-without-offsets": (
        lambda c: _rewrite_header(c / SHARDS[0], lambda h: h["a.bias"].pop("data_offsets")),
        rf"{S0}: header entry of tensor a\.bias is malformed",
    ),
    "index-lists-a-tensor-the-shard-lacks": (
        lambda c: _edit_index(c, lambda m: m.update({"ghost.weight": SHARDS[0]})),
        rf"{S0}: {re.escape(INDEX_NAME)} lists 1 tensor\(s\) that this shard's header lacks, e\.g\. ghost\.weight",
    ),
    "shard-holds-a-tensor-the-index-omits": (
        lambda c: _edit_index(c, lambda m: m.pop("a.bias")),
        rf"{S0}: holds tensor a\.bias, but {re.escape(INDEX_NAME)} does not list it",
    ),
    "index-maps-a-tensor-to-another-shard": (
        lambda c: _edit_index(c, lambda m: m.update({"a.bias": SHARDS[1]})),
        rf"{S0}: holds tensor a\.bias, but {re.escape(INDEX_NAME)} maps it to {S1}",
    ),
    "index-not-json": (lambda c: (c / INDEX_NAME).write_text("{"), rf"{re.escape(INDEX_NAME)} is not a valid safetensors index"),
    "index-without-weight-map": (lambda c: (c / INDEX_NAME).write_text("{}"),
                                 rf"{re.escape(INDEX_NAME)} is not a valid safetensors index"),
    "no-index-no-single-file": (lambda c: (c / INDEX_NAME).unlink(), rf"has neither {re.escape(INDEX_NAME)} nor"),
}


@pytest.mark.parametrize("fault", list(FAULTS), ids=list(FAULTS))
def test_every_header_fault_is_refused_naming_the_file(fault: str, tmp_path: Path) -> None:
    ckpt = _write(tmp_path / "ckpt")
    breaks, message = FAULTS[fault]
    breaks(ckpt)
    with pytest.raises(CheckpointError, match=message):
        CheckpointReader(ckpt)


def test_a_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="checkpoint directory .* does not exist"):
        CheckpointReader(tmp_path / "nowhere")


def test_refusals_are_value_errors() -> None:
    """User input (a checkpoint path) that is refused: the CLIs' expected-error path, a ValueError."""
    from modelopt_k3.checkpoint.source_check import SourceMismatchError
    from modelopt_k3.convert import ConvertError

    assert issubclass(CheckpointError, ValueError)
    assert issubclass(SourceMismatchError, ValueError)
    assert issubclass(ConvertError, ValueError)


@pytest.mark.parametrize("single", [False, True], ids=["index", "single-file"])
def test_both_read_modes_return_the_stored_bytes_and_record_them(tmp_path: Path, single: bool) -> None:
    ckpt = _write(tmp_path / "ckpt", single=single)
    expected = {k: v for t in TENSORS.values() for k, v in t.items()}
    with CheckpointReader(ckpt) as reader:
        assert set(reader.names()) == set(expected)
        assert reader.files == ([SINGLE_NAME] if single else list(SHARDS))
        for key, want in expected.items():
            info = reader.info(key)
            assert (info.dtype, info.shape, info.nbytes) == (want.dtype, tuple(want.shape), want.nbytes)
            for got in (reader.get(key), reader.pread(key)):
                assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(reader.get_rows("a.weight", 1, 3), expected["a.weight"][1:3])
    assert reader.log.keys.count("a.weight") == 3  # get, pread, get_rows
    # NaN in a float tensor and the E8M0 NaN byte in an MXFP4 scale are recorded, by name.
    assert set(reader.log.invalid) == {"a.bias", "b.weight_scale"}


def test_pread_records_into_the_given_log_and_reads_no_other_bytes(tmp_path: Path) -> None:
    from modelopt_k3.checkpoint import ReadLog

    ckpt = _write(tmp_path / "ckpt")
    reader = CheckpointReader(ckpt)
    log = ReadLog()
    reader.pread("b.weight_scale", log)
    reader.close()
    assert (log.keys, log.bytes, list(log.invalid)) == (["b.weight_scale"], 2, ["b.weight_scale"])
    assert reader.log.keys == []


def test_hashed_reads_name_what_was_read_and_sha256_rereads_the_same_bytes(tmp_path: Path) -> None:
    """A layerwise resume's source identity: each read (whole tensor, or rows as ``key[a:b]``) hashed from the
    bytes read, equal to ``sha256`` of the stored range, which changes when a byte of that range does."""
    import hashlib

    from modelopt_k3.checkpoint.reader import parse_read, rows_read

    ckpt = _write(tmp_path / "ckpt")
    want = TENSORS[SHARDS[0]]["a.weight"]
    with CheckpointReader(ckpt) as reader:
        reader.log.hashes = {}
        reader.get("a.weight")
        reader.get_rows("a.weight", 1, 3)
        reader.pread("b.weight_scale")
        hashes = dict(reader.log.hashes)
        assert set(hashes) == {"a.weight", rows_read("a.weight", 1, 3), "b.weight_scale"}
        assert parse_read(rows_read("a.weight", 1, 3)) == ("a.weight", (1, 3))
        assert hashes["a.weight"] == hashlib.sha256(want.view(torch.uint8).numpy().tobytes()).hexdigest()
        assert hashes["a.weight[1:3]"] == hashlib.sha256(want[1:3].contiguous().view(torch.uint8).numpy()).hexdigest()
        assert all(reader.sha256(read) == sha for read, sha in hashes.items())
        assert hashes["a.weight[1:3]"] != hashes["a.weight"]
        info = reader.info("a.weight")
    path = ckpt / info.file
    data = bytearray(path.read_bytes())
    data[info.offset + info.nbytes // 3 * 2] ^= 1  # a byte of row 2
    path.write_bytes(bytes(data))
    with CheckpointReader(ckpt) as reader:
        assert reader.sha256("a.weight[1:3]") != hashes["a.weight[1:3]"]
        assert reader.sha256("a.weight[0:1]") == hashlib.sha256(want[0:1].contiguous().view(torch.uint8).numpy()).hexdigest()


def test_the_header_digest_covers_every_header_and_size(tmp_path: Path) -> None:
    """The converter's resume key: equal for equal headers, different when any header changes."""
    a, b = _write(tmp_path / "a"), _write(tmp_path / "b")
    assert CheckpointReader(a).header_digest == CheckpointReader(b).header_digest
    assert read_header(b / SHARDS[0]) == _header(b / SHARDS[0])[1]
    _rewrite_header(b / SHARDS[1], lambda h: h["__metadata__"].update(note="x"))
    assert CheckpointReader(a).header_digest != CheckpointReader(b).header_digest


def _parses_safetensors_headers(tree: ast.AST) -> bool:
    """Whether a module unpacks a safetensors length prefix (``struct.unpack("<Q", ...)``)."""
    return any(
        isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "unpack"
        and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "<Q"
        for node in ast.walk(tree)
    )


def test_the_reader_is_the_only_safetensors_header_parser() -> None:
    parsers = sorted(
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
        if "remote_code" not in p.parts and _parses_safetensors_headers(ast.parse(p.read_text()))
    )
    assert parsers == ["checkpoint/reader.py"]
