"""Streaming shard writer, index merge and the atomic export directory (world 1 and gloo ranks)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _mp import run_ranks
from safetensors import safe_open

from modelopt_k3.dist import group as group_mod
from modelopt_k3.dist.collectives import run_together
from modelopt_k3.dist.group import run_group
from modelopt_k3.export.writer import (
    INDEX_NAME,
    PlannedShard,
    PlannedTensor,
    ShardWriter,
    atomic_output_dir,
    file_digest,
    gather_weight_maps,
    write_index,
)


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    group_mod.destroy_run_group()
    yield
    group_mod.destroy_run_group()


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _tensors(seed: int = 0, prefix: str = "layers") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(8, 16, generator=g)
    return {
        f"{prefix}.0.w_bf16": torch.randn(10, 12, generator=g).to(torch.bfloat16),  # 240 B
        f"{prefix}.0.w_fp8": torch.randn(16, 16, generator=g).to(torch.float8_e4m3fn),  # 256 B
        f"{prefix}.0.packed": torch.randint(0, 256, (20, 8), dtype=torch.uint8, generator=g),  # 160 B
        f"{prefix}.0.scale_2": torch.tensor(0.25),  # 4 B, 0-dim
        f"{prefix}.1.big": torch.randn(300, generator=g),  # 1200 B: bigger than a shard
        f"{prefix}.1.transposed": torch.randn(6, 7, generator=g).t(),  # non-contiguous view
        f"{prefix}.1.gate": fused[:4],  # views of one fused tensor (shared storage)
        f"{prefix}.1.up": fused[4:],
        f"{prefix}.1.ids": torch.arange(5, dtype=torch.int64),
    }


def _read_all(out_dir: Path, weight_map: dict[str, str]) -> dict[str, torch.Tensor]:
    out = {}
    for fname in sorted(set(weight_map.values())):
        with safe_open(out_dir / fname, framework="pt") as f:
            assert f.metadata()["format"] == "pt"
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                assert weight_map[key] == fname
                out[key] = f.get_tensor(key)
    return out


# --------------------------------------------------------------------------- ShardWriter


def test_shard_writer_bounded_shards_and_exact_roundtrip(tmp_path):
    tensors = _tensors()
    limit = 512
    with ShardWriter(tmp_path, rank=3, max_shard_bytes=limit) as w:
        for name, t in tensors.items():
            w.add(name, t)
            assert w._buffer_bytes <= max(limit, t.nbytes)  # memory bounded by ~one shard
    weight_map = w.close()
    assert set(weight_map) == set(tensors)
    assert w.total_bytes == sum(t.nbytes for t in tensors.values())
    files = sorted(set(weight_map.values()))
    assert files == [f"model-r00003-{i:05d}.safetensors" for i in range(len(files))]
    assert sorted(p.name for p in tmp_path.iterdir()) == files
    for fname in files:
        keys = [k for k, f in weight_map.items() if f == fname]
        size = sum(tensors[k].nbytes for k in keys)
        assert size <= limit or len(keys) == 1, (fname, keys, size)
    back = _read_all(tmp_path, weight_map)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert _bytes(back[name]) == _bytes(t), name


@pytest.mark.parametrize("spill_bytes", [0, 2**20], ids=["spilled", "save_file"])
def test_views_are_buffered_without_a_copy_and_written_exactly(tmp_path, spill_bytes):
    """A view (slices of one batched tensor) is kept as it is, not copied, when added; the shard holds its
    bytes exactly whether it is spilled (bytes taken from the view) or written by ``save_file`` (which gets
    copies of views and of tensors sharing memory, at the write)."""
    tensors = _tensors()
    tensors["layers.1.gate_again"] = tensors["layers.1.gate"]  # one tensor under two names (tied)
    with ShardWriter(tmp_path, spill_bytes=spill_bytes) as w:
        for name, t in tensors.items():
            w.add(name, t)
            if t.is_contiguous() and spill_bytes:
                assert w._buffer[name].data_ptr() == t.data_ptr(), name  # no copy made at add
    back = _read_all(tmp_path, w.close())
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert _bytes(back[name]) == _bytes(t), name


def test_shard_writer_refuses_duplicates_and_use_after_close(tmp_path):
    w = ShardWriter(tmp_path, max_shard_bytes=64)
    w.add("a.weight", torch.zeros(32))  # flushed by the next add
    w.add("b.weight", torch.zeros(2))
    with pytest.raises(ValueError, match=r"tensor 'a.weight' added twice \(first in model-r00000-00000"):
        w.add("a.weight", torch.ones(2))
    with pytest.raises(ValueError, match="'b.weight' added twice"):
        w.add("b.weight", torch.ones(2))
    w.close()
    with pytest.raises(RuntimeError, match="is closed; cannot add 'c'"):
        w.add("c", torch.ones(1))


def test_shard_writer_error_inside_with_leaves_no_partial_shard(tmp_path):
    with pytest.raises(ZeroDivisionError), ShardWriter(tmp_path) as w:
        w.add("a", torch.ones(3))
        1 / 0  # noqa: B018
    assert list(tmp_path.iterdir()) == []


def test_shard_writer_extra_metadata(tmp_path):
    with ShardWriter(tmp_path, prefix="part", metadata={"recipe": "nvfp4"}) as w:
        w.add("x", torch.ones(2))
    with safe_open(tmp_path / "part-r00000-00000.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt", "recipe": "nvfp4"}


# --------------------------------------------------------------------------- index


def _write_ranks(out_dir: Path, n: int, limit: int = 700) -> tuple[list[dict[str, str]], int, dict]:
    maps, total, expected = [], 0, {}
    for rank in range(n):
        tensors = _tensors(seed=rank, prefix=f"rank{rank}")
        expected.update(tensors)
        with ShardWriter(out_dir, rank=rank, max_shard_bytes=limit) as w:
            for name, t in tensors.items():
                w.add(name, t)
        maps.append(w.weight_map)
        total += w.total_bytes
    return maps, total, expected


def test_write_index_merges_and_renames(tmp_path):
    maps, total, expected = _write_ranks(tmp_path, 3)
    n_files = len({(r, f) for r, m in enumerate(maps) for f in m.values()})
    final = write_index(tmp_path, maps, total)

    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"] == {"total_size": sum(t.nbytes for t in expected.values())}
    assert index["weight_map"] == final and list(final) == sorted(expected)
    names = [f"model-{i:05d}-of-{n_files:05d}.safetensors" for i in range(1, n_files + 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names, INDEX_NAME])
    # Rank order first: rank 0's first shard is file 1, the last rank's last shard is file n.
    assert final["rank0.0.w_bf16"] == names[0] and final["rank2.1.ids"] == names[-1]
    back = _read_all(tmp_path, final)
    assert set(back) == set(expected)
    for name, t in expected.items():
        assert _bytes(back[name]) == _bytes(t), name


def test_write_index_without_rename_keeps_names(tmp_path):
    maps, total, _ = _write_ranks(tmp_path, 2)
    final = write_index(tmp_path, maps, total, rename=False)
    assert final == dict(sorted({k: v for m in maps for k, v in m.items()}.items()))


def test_write_index_refuses_key_written_by_two_ranks(tmp_path):
    maps, total, _ = _write_ranks(tmp_path, 2)
    maps[1]["rank0.1.big"] = next(iter(maps[1].values()))
    with pytest.raises(
        ValueError, match=r"tensor 'rank0.1.big' was written twice: by rank 0 in .* and by rank 1"
    ):
        write_index(tmp_path, maps, total)


def test_write_index_refuses_shared_file_and_missing_file_and_empty(tmp_path):
    with pytest.raises(ValueError, match="shard file f.safetensors is listed by rank 0 and rank 1"):
        write_index(tmp_path, [{"a": "f.safetensors"}, {"b": "f.safetensors"}], 8)
    with pytest.raises(FileNotFoundError, match="1 shard file.* missing .* e.g. f.safetensors"):
        write_index(tmp_path, [{"a": "f.safetensors"}], 8)
    with pytest.raises(ValueError, match="no tensors were written"):
        write_index(tmp_path, [{}, {}], 0)


def test_gather_weight_maps_world_1():
    assert gather_weight_maps({"a": "f"}, 12) == ([{"a": "f"}], 12)


# --------------------------------------------------------------------------- atomic_output_dir, world 1


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


def test_atomic_output_dir_success(tmp_path):
    export = tmp_path / "out" / "ckpt"
    with atomic_output_dir(export) as tmp:
        assert tmp.parent == export.parent and tmp.name.startswith(".ckpt.tmp-") and tmp.is_dir()
        assert not export.exists()
        (tmp / "config.json").write_text("{}")
    assert (export / "config.json").read_text() == "{}"
    assert _siblings(export) == ["ckpt"]


def test_atomic_output_dir_error_leaves_nothing(tmp_path):
    export = tmp_path / "ckpt"
    with pytest.raises(OSError, match="disk full"), atomic_output_dir(export) as tmp:
        (tmp / "model-r00000-00000.safetensors").write_bytes(b"partial")
        raise OSError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_atomic_output_dir_refuses_non_empty_unless_overwrite(tmp_path):
    export = tmp_path / "ckpt"
    export.mkdir()
    (export / "old.safetensors").write_bytes(b"old")
    with pytest.raises(FileExistsError, match="already exists and is not empty; pass overwrite=True"):  # noqa: SIM117
        with atomic_output_dir(export):
            pytest.fail("body must not run")
    assert _siblings(export) == ["ckpt"] and (export / "old.safetensors").exists()

    with atomic_output_dir(export, overwrite=True) as tmp:
        (tmp / "new.safetensors").write_bytes(b"new")
        assert (export / "old.safetensors").exists()  # old one stays until the new one is complete
    assert sorted(p.name for p in export.iterdir()) == ["new.safetensors"]
    assert _siblings(export) == ["ckpt"]


def test_atomic_output_dir_overwrite_failure_keeps_old(tmp_path):
    export = tmp_path / "ckpt"
    export.mkdir()
    (export / "old.safetensors").write_bytes(b"old")
    with pytest.raises(RuntimeError, match="calibration failed"), atomic_output_dir(export, overwrite=True):
        raise RuntimeError("calibration failed")
    assert _siblings(export) == ["ckpt"] and (export / "old.safetensors").read_bytes() == b"old"


def test_atomic_output_dir_accepts_existing_empty_dir(tmp_path):
    export = tmp_path / "ckpt"
    export.mkdir()
    with atomic_output_dir(export) as tmp:
        (tmp / "a").write_text("a")
    assert (export / "a").exists() and _siblings(export) == ["ckpt"]


# --------------------------------------------------------------------------- real gloo ranks


def _export_worker(export_dir: str, failing_rank: int | None):
    with run_group() as g:
        with atomic_output_dir(export_dir) as tmp:

            def write_mine():
                with ShardWriter(tmp, rank=g.rank, max_shard_bytes=600) as w:
                    for name, t in _tensors(seed=g.rank, prefix=f"rank{g.rank}").items():
                        w.add(name, t)
                if g.rank == failing_rank:
                    raise OSError(f"quota exceeded on rank {g.rank}")
                return w.weight_map, w.total_bytes

            local_map, local_bytes = run_together("write shards", write_mine)
            maps, total = gather_weight_maps(local_map, local_bytes)
            run_together("write index", lambda: write_index(tmp, maps, total) if g.is_main else None)
        return g.rank


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4])
def test_multi_rank_export(tmp_path, n):
    export = tmp_path / "ckpt"
    results = run_ranks(n, _export_worker, str(export), None, timeout=60)
    assert [r.exitcode for r in results] == [0] * n, [r.traceback for r in results]
    assert _siblings(export) == ["ckpt"]
    index = json.loads((export / INDEX_NAME).read_text())
    expected = {k: v for rank in range(n) for k, v in _tensors(seed=rank, prefix=f"rank{rank}").items()}
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in expected.values())
    back = _read_all(export, index["weight_map"])
    assert set(back) == set(expected)
    for name, t in expected.items():
        assert _bytes(back[name]) == _bytes(t), name


@pytest.mark.multiprocess
def test_multi_rank_export_one_rank_fails(tmp_path):
    export = tmp_path / "ckpt"
    results = run_ranks(2, _export_worker, str(export), 1, timeout=60)
    assert [r.exitcode for r in results] == [1, 1], results
    for r in results:
        assert r.error.startswith(
            f"DistributedStepError: step 'write shards' failed on rank 1 (seen from rank {r.rank}): "
            "rank 1: OSError: quota exceeded on rank 1"
        ), r.error
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no temporary directory


_BODY_FAILS_SCRIPT = """
import sys
from pathlib import Path
from modelopt_k3.dist.group import run_group
from modelopt_k3.export.writer import atomic_output_dir

with run_group() as g, atomic_output_dir(sys.argv[1]) as tmp:
    (tmp / f"model-r{g.rank:05d}-00000.safetensors").write_bytes(b"x")
    if g.rank == 0:
        raise RuntimeError("rank 0 ran out of memory")
print("unreachable", flush=True)
"""


@pytest.mark.multiprocess
def test_multi_rank_uncaught_failure_in_body_script(tmp_path):
    """Like a torchrun launch: the body fails on rank 0 only; both processes exit non-zero, nothing left."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(_BODY_FAILS_SCRIPT))
    export = tmp_path / "out" / "ckpt"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), *sys.path]))}
    results = run_ranks(2, script, str(export), timeout=90, env=env)
    assert [r.exitcode for r in results] == [1, 1], [r.output for r in results]
    for r in results:
        assert "unreachable" not in r.output
        assert (
            "DistributedStepError: step 'write export dir' failed on rank 0 "
            f"(seen from rank {r.rank}): rank 0: RuntimeError: rank 0 ran out of memory"
        ) in r.output, r.output
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("kernel_copy", [True, False], ids=["copy_file_range", "buffered"])
def test_spilled_shards_read_back_byte_equal(tmp_path, monkeypatch, kernel_copy):
    """Past ``spill_bytes`` tensors go to a spill file; shards assembled from it read back exactly (spilled
    bytes copied in the kernel, or through a buffer where the filesystem refuses)."""
    if not kernel_copy:
        def refuse(*a, **k):
            raise OSError(18, "Invalid cross-device link")

        monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    dtypes = [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8]
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": (torch.randn(50, 24, generator=g) * 7).to(dtypes[i % 4]) for i in range(24)}
    tensors["scalar"] = torch.tensor(0.125)
    with ShardWriter(tmp_path, max_shard_bytes=12_000, spill_bytes=3_000) as writer:
        for name, t in tensors.items():
            writer.add(name, t)
            assert writer._buffer_bytes - sum(x.nbytes for x in writer._buffer.values()) >= 0
            assert sum(x.nbytes for x in writer._buffer.values()) <= 3_000 + t.nbytes
    weight_map = writer.close()
    assert len(set(weight_map.values())) > 1
    assert not list(tmp_path.glob(".*spill")), "spill files left behind"
    for name, t in tensors.items():
        with safe_open(tmp_path / weight_map[name], framework="pt") as f:
            got = f.get_tensor(name)
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    for file in set(weight_map.values()):
        assert (tmp_path / file).stat().st_size <= 12_000 + 2_000  # data bound plus header


def test_spill_file_removed_on_error(tmp_path):
    with pytest.raises(RuntimeError), ShardWriter(tmp_path, spill_bytes=100) as writer:
        writer.add("a", torch.zeros(1000))
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- PlannedShard (the converter's)


def _planned(tensors: dict[str, torch.Tensor]) -> list[PlannedTensor]:
    return [PlannedTensor(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]


def test_planned_shard_written_out_of_order_from_threads_reads_back_aligned(tmp_path):
    """Header first, each tensor at its planned offset from any thread: safetensors reads the file back
    byte-equal, every tensor aligned to its element size (largest elements first)."""
    from concurrent.futures import ThreadPoolExecutor

    tensors = {name: t.contiguous() for name, t in _tensors().items()}
    shard = PlannedShard(tmp_path / "out.safetensors", _planned(tensors))
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda kv: shard.write(*kv), reversed(list(tensors.items()))))
    shard.close()
    assert (tmp_path / "out.safetensors").stat().st_size == shard.total_bytes
    assert shard.tensor_bytes == sum(t.nbytes for t in tensors.values())
    got = _read_all(tmp_path, dict.fromkeys(tensors, "out.safetensors"))
    assert all(_bytes(got[k]) == _bytes(t) and got[k].dtype == t.dtype for k, t in tensors.items())
    assert all(shard.offsets[k] % t.element_size() == 0 for k, t in tensors.items())
    sizes = [tensors[k].element_size() for k in sorted(tensors, key=shard.offsets.get)]
    assert sizes == sorted(sizes, reverse=True)
    # The digest taken while writing (out of order) is the one read back from the file; any change shows.
    path = tmp_path / "out.safetensors"
    assert shard.digest.hexdigest() == file_digest(path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert file_digest(path) not in ("", shard.digest.hexdigest())
    path.write_bytes(bytes(data[:-1]))
    assert file_digest(path) == ""  # truncated: matches no record


def test_planned_and_buffered_shards_share_one_header_layout(tmp_path):
    """A spilled ShardWriter shard and a PlannedShard of same-size tensors in the same order are the same file."""
    g = torch.Generator().manual_seed(1)
    tensors = {f"t{i}": torch.randn(7, 5, generator=g) for i in range(4)}
    (tmp_path / "w").mkdir()
    with ShardWriter(tmp_path / "w", spill_bytes=0) as w:
        for name, t in tensors.items():
            w.add(name, t)
    shard = PlannedShard(tmp_path / "planned.safetensors", _planned(tensors))
    for name, t in tensors.items():
        shard.write(name, t)
    shard.close()
    assert (tmp_path / "planned.safetensors").read_bytes() == (tmp_path / "w" / w.weight_map["t0"]).read_bytes()


def test_planned_shard_refuses_an_unplanned_tensor_and_discard_removes_the_file(tmp_path):
    shard = PlannedShard(tmp_path / "x.safetensors", [PlannedTensor("a", torch.float32, (2, 3))])
    with pytest.raises(AssertionError, match=r"a: produced torch.bfloat16 \[2, 3\], planned torch.float32 \[2, 3\]"):
        shard.write("a", torch.zeros(2, 3, dtype=torch.bfloat16))
    shard.discard()
    assert list(tmp_path.iterdir()) == []


def test_planned_shard_copies_source_tensors_and_counts_nonfinite(tmp_path):
    """The copy path: floating tensors through a checked buffer (NaN/Inf counted), others in the kernel."""
    from safetensors.torch import save_file

    from modelopt_k3.checkpoint import CheckpointReader

    src = {"f": torch.tensor([1.0, float("nan"), float("inf"), 2.0]), "u": torch.arange(6, dtype=torch.uint8)}
    (tmp_path / "src").mkdir()
    save_file(src, str(tmp_path / "src" / "model.safetensors"))
    reader = CheckpointReader(tmp_path / "src")
    shard = PlannedShard(tmp_path / "out.safetensors", _planned(src))
    assert shard.copy(reader, "f") == "2 NaN/Inf values"
    assert shard.copy(reader, "u") is None
    shard.close()
    assert shard.digest.hexdigest() == file_digest(tmp_path / "out.safetensors")
    reader.close()
    got = _read_all(tmp_path, {"f": "out.safetensors", "u": "out.safetensors"})
    assert all(_bytes(got[k]) == _bytes(t) for k, t in src.items())
