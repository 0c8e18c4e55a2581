"""A lying checkpoint: headers, indexes and files that the one reader (``modelopt_k3.checkpoint``) must refuse
in milliseconds, naming the file and the tensor, before a tensor byte is read; both tools refuse them in
one line, the source untouched.

Unit-level on a two-shard checkpoint of a few tensors (no model); two command line runs show the tools use
the same reader.
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from faults.helpers import MIRROR, SMALL, temp_leftovers, tree_digest
from modelopt_k3.checkpoint import (
    INDEX_NAME,
    MAX_HEADER_BYTES,
    CheckpointError,
    CheckpointReader,
    read_config,
)

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
REFUSAL_BUDGET_S = 1.0


def _write(path: Path) -> Path:
    path.mkdir(parents=True)
    tensors = {
        SHARDS[0]: {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
                    "a.bias": torch.arange(4, dtype=torch.float32)},
        SHARDS[1]: {"b.weight": torch.arange(8, dtype=torch.uint8).reshape(2, 4)},
    }
    weight_map = {}
    for file, ts in tensors.items():
        save_file(ts, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(ts, file))
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text("{}")
    return path


def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _put(path: Path, header_text: bytes, data: bytes) -> None:
    header_text += b" " * (-len(header_text) % 8)
    path.write_bytes(struct.pack("<Q", len(header_text)) + header_text + data)


def _edit(edit: Callable[[dict], None], file: str = SHARDS[0]) -> Callable[[Path], None]:
    def apply(ckpt: Path) -> None:
        header, data = _split(ckpt / file)
        edit(header)
        _put(ckpt / file, json.dumps(header).encode(), data)

    return apply


def _declared_header(n: int) -> Callable[[Path], None]:
    """A shard whose length prefix claims ``n`` header bytes, in a sparse file that really is that long."""
    def apply(ckpt: Path) -> None:
        with open(ckpt / SHARDS[0], "wb") as f:
            f.write(struct.pack("<Q", n) + b"{")
            f.truncate(8 + n + 8)

    return apply


def _shift(key: str, by: int, grow: int = 0) -> Callable[[Path], None]:
    """Move ``key``'s data_offsets by ``by`` bytes (the file grown by ``grow`` so that it still fits)."""
    def apply(ckpt: Path) -> None:
        header, data = _split(ckpt / SHARDS[0])
        assert header["a.bias"]["data_offsets"] == [0, 16] and header["a.weight"]["data_offsets"] == [16, 64]
        header[key]["data_offsets"] = [o + by for o in header[key]["data_offsets"]]
        _put(ckpt / SHARDS[0], json.dumps(header).encode(), data + b"\0" * grow)

    return apply


def _duplicate_key(ckpt: Path) -> None:
    header, data = _split(ckpt / SHARDS[0])
    text = json.dumps(header)
    # The same key twice: JSON parsers keep the last one silently (a.bias would read a.weight's bytes).
    dup = json.dumps({"a.bias": header["a.weight"]})[1:-1]
    _put(ckpt / SHARDS[0], (text[:-1] + ", " + dup + "}").encode(), data)


def _index_names(name: str) -> Callable[[Path], None]:
    def apply(ckpt: Path) -> None:
        index = json.loads((ckpt / INDEX_NAME).read_text())
        index["weight_map"]["b.weight"] = name
        (ckpt / INDEX_NAME).write_text(json.dumps(index))

    return apply


def _symlinked_shard(ckpt: Path) -> None:
    outside = ckpt.parent / "elsewhere.safetensors"
    (ckpt / SHARDS[1]).rename(outside)
    (ckpt / SHARDS[1]).symlink_to(outside)


def _fifo(name: str) -> Callable[[Path], None]:
    def apply(ckpt: Path) -> None:
        (ckpt / name).unlink()
        os.mkfifo(ckpt / name)

    return apply


S0 = re.escape(SHARDS[0])
FAULTS: dict[str, tuple[Callable[[Path], None], str]] = {
    "3-GiB-declared-header": (_declared_header(3 * 2**30), rf"{S0} has a corrupt safetensors header: the header "
                              rf"claims {3 * 2**30} bytes, more than safetensors' limit of {MAX_HEADER_BYTES}"),
    "101-MB-declared-header": (_declared_header(101_000_000), r"more than safetensors' limit of 100000000"),
    "duplicate-header-key": (_duplicate_key, rf"{S0} has a corrupt safetensors header: key 'a.bias' appears twice"),
    "negative-dims-same-bytes": (_edit(lambda h: h["a.weight"].update(shape=[-3, -4])),
                                 rf"{S0}: tensor a\.weight has a negative dimension in its shape \[-3, -4\]"),
    "overlapping-offsets": (_shift("a.weight", -8), rf"{S0}: tensor a\.weight's data_offsets \[8, 56\] overlaps"),
    "gap-between-tensors": (_shift("a.weight", 4, grow=4), rf"{S0}: tensor a\.weight's data_offsets \[20, 68\] leaves a gap"),
    "trailing-bytes": (lambda c: (c / SHARDS[1]).write_bytes((c / SHARDS[1]).read_bytes() + b"\0" * 8),
                       r"the tensors end at byte \d+ but the file has \d+ bytes"),
    "boolean-dim": (_edit(lambda h: h["a.bias"].update(shape=[True] * 1)), r"header entry of tensor a\.bias is malformed"),
    "float-offset": (_edit(lambda h: h["a.bias"].update(data_offsets=[float(o) for o in h["a.bias"]["data_offsets"]])),
                     r"header entry of tensor a\.bias is malformed"),
    "NaN-in-header": (_edit(lambda h: h["__metadata__"].update(x=float("nan"))), r"corrupt safetensors header: NaN"),
    "index-parent-dir": (_index_names("../x.safetensors"), r"shard name '\.\./x\.safetensors' leaves the checkpoint"),
    "index-absolute": (_index_names("/etc/passwd"), r"shard name '/etc/passwd' leaves the checkpoint"),
    "index-sub-dot-dot": (_index_names("sub/../../../x"), r"shard name 'sub/\.\./\.\./\.\./x' leaves the checkpoint"),
    "index-subdirectory": (_index_names("sub/x.safetensors"), r"leaves the checkpoint"),
    "index-duplicate-key": (lambda c: (c / INDEX_NAME).write_text('{"weight_map": {}, "weight_map": {}}'),
                            r"not a valid safetensors index: .*key 'weight_map' appears twice"),
    "shard-symlink-outside": (_symlinked_shard, r"resolves to .*elsewhere\.safetensors, outside the checkpoint"),
    "shard-is-a-fifo": (_fifo(SHARDS[1]), r"is a FIFO; only regular files are read"),
    "index-is-a-fifo": (_fifo(INDEX_NAME), r"is a FIFO; only regular files are read"),
    "shard-is-a-directory": (lambda c: ((c / SHARDS[1]).unlink(), (c / SHARDS[1]).mkdir()), r"is a directory"),
}


@pytest.fixture
def alarm():
    """Fail instead of hanging (a FIFO opened for reading blocks until a writer comes)."""
    def hang(*_):
        raise TimeoutError("the reader hung")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("fault", list(FAULTS), ids=list(FAULTS))
def test_the_reader_refuses_a_lying_checkpoint_at_once(fault: str, tmp_path: Path, alarm) -> None:
    ckpt = _write(tmp_path / "ckpt")
    breaks, message = FAULTS[fault]
    breaks(ckpt)
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=message) as info:
        CheckpointReader(ckpt)
    seconds = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert seconds < REFUSAL_BUDGET_S, seconds
    assert peak < 16 * 2**20, f"{peak} bytes allocated to refuse it"  # a 3 GiB claim is never allocated
    assert "\n" not in str(info.value)


def test_a_config_that_is_a_fifo_is_refused_not_waited_on(tmp_path: Path, alarm) -> None:
    ckpt = _write(tmp_path / "ckpt")
    _fifo("config.json")(ckpt)
    with pytest.raises(CheckpointError, match=r"config\.json is a FIFO"):
        read_config(ckpt)


def test_a_hugging_face_cache_snapshot_links_into_its_blobs(tmp_path: Path) -> None:
    """``<repo>/snapshots/<rev>/<file> -> ../../blobs/<hash>``: how the hub cache stores every file. Reading
    through such links works; a link out of the repository's blobs is refused."""
    made = _write(tmp_path / "made")
    repo = tmp_path / "hub" / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, p in enumerate(sorted(made.iterdir())):
        (blobs / f"blob{i}").write_bytes(p.read_bytes())
        (snap / p.name).symlink_to(Path("../../blobs") / f"blob{i}")
    with CheckpointReader(snap) as reader:
        assert torch.equal(reader.pread("a.weight"), torch.arange(12, dtype=torch.float32).reshape(3, 4))
    outside = tmp_path / "stray.safetensors"
    outside.write_bytes((made / SHARDS[1]).read_bytes())
    (snap / SHARDS[1]).unlink()
    (snap / SHARDS[1]).symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"outside the checkpoint directory .* and its Hugging Face cache blobs"):
        CheckpointReader(snap)


# --------------------------------------------------------------------------- the tools refuse in one line


def _overlapping_expert_offsets(ckpt: Path) -> None:
    """Two expert tensors of one shard given the same bytes (the red team's ``up_proj == gate_proj``)."""
    index = json.loads((ckpt / INDEX_NAME).read_text())["weight_map"]
    w1 = next(k for k in index if k.endswith("experts.0.w1.weight_packed"))
    w3 = w1.replace(".w1.", ".w3.")
    file = index[w1]
    assert index[w3] == file

    def same_bytes(h: dict) -> None:
        h[w3]["data_offsets"] = h[w1]["data_offsets"]

    _edit(same_bytes, file)(ckpt)


@pytest.mark.parametrize("tool", ["convert", "ptq"])
@pytest.mark.parametrize("fault", ["overlapping-expert-offsets", "index-parent-dir"])
def test_both_tools_refuse_in_one_line_and_touch_nothing(tool, fault, copy_ckpt, tmp_path, run_tool) -> None:
    src = copy_ckpt()
    if fault == "index-parent-dir":
        index = json.loads((src / INDEX_NAME).read_text())
        key = next(iter(index["weight_map"]))
        index["weight_map"][key] = "../" + index["weight_map"][key]
        (src / INDEX_NAME).write_text(json.dumps(index))
        message = r"leaves the checkpoint directory"
    else:
        _overlapping_expert_offsets(src)
        message = r"data_offsets .* overlaps the tensor before it"
    before = tree_digest(src.parent)
    out = tmp_path / "out"
    t0 = time.perf_counter()
    if tool == "convert":
        rc, _, err = run_tool("convert", ["--src", src, "--dst", out, "--recipe", MIRROR, "--no_progress"])
    else:
        rc, _, err = run_tool("ptq", ["--pyt_ckpt_path", src, "--trust_remote_code", "--export_path", out, *SMALL])
    assert time.perf_counter() - t0 < 5.0
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and re.search(message, lines[0]), err
    assert tree_digest(src.parent) == before
    assert not out.exists() and temp_leftovers(out) == []
