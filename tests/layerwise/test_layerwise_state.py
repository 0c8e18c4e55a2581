"""What a layerwise resume trusts (``layerwise/state.py``) and how ranks agree where to resume, without a
model: each test holds the case a plausible wrong answer gets wrong (issue 33)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import modelopt_k3.layerwise as layerwise
from modelopt_k3.layerwise.replay import Captured
from modelopt_k3.layerwise.state import LayerRecord, RankDir, ResumeError, source_digest


def _commit(d: RankDir, i: int, value: float) -> None:
    shard = f"layer{i:05d}-r00000-00000.safetensors"
    (d.path / shard).write_bytes(b"x")
    d.commit(LayerRecord(i, {f"k{i}": shard}, 1, {}), {"q": torch.ones(1)}, [Captured.of((torch.full((2,), value),), {})])


def test_a_resume_refuses_a_checkpoint_of_another_source(tmp_path: Path):
    fp = {"source checkpoint": "a", "recipe": "r"}
    _commit(RankDir(tmp_path, 0, fp), 0, 1.0)
    with pytest.raises(ResumeError, match="another source checkpoint;"):
        RankDir(tmp_path, 0, {**fp, "source checkpoint": "b"}).load()
    assert RankDir(tmp_path, 0, fp).load() == 1


def test_the_source_digest_is_the_sources_shape_its_content_is_checked_per_layer(tmp_path: Path):
    """A ``touch`` (or a copy) keeps the digest: the bytes are each layer's record's to check (``source``);
    another size or config.json is another source at once."""
    (tmp_path / "config.json").write_text("{}")
    shard = tmp_path / "model-00001.safetensors"
    shard.write_bytes(b"a" * 64)
    before = source_digest(tmp_path)
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert source_digest(tmp_path) == before
    shard.write_bytes(b"a" * 65)
    assert source_digest(tmp_path) != before
    shard.write_bytes(b"a" * 64)
    (tmp_path / "config.json").write_text('{"a": 1}')
    assert source_digest(tmp_path) != before


def test_a_layer_whose_source_changed_is_refused_naming_it(tmp_path: Path):
    """``RankDir.load`` asks the loader about every committed record's reads; the first change is refused."""
    fp = {"source checkpoint": "a"}
    d = RankDir(tmp_path, 0, fp)
    shard = "layer00000-r00000-00000.safetensors"
    (d.path / shard).write_bytes(b"x")
    d.commit(LayerRecord(0, {"k0": shard}, 1, {}, source={"w0": "s0"}, source_files={"m.safetensors": [1, 2, 3, 4]}),
             {"q": torch.ones(1)}, [Captured.of((torch.ones(2),), {})])
    seen = []

    def unchanged(reads, files):
        seen.append((reads, files))
        return None

    assert RankDir(tmp_path, 0, fp).load(unchanged) == 1
    assert seen == [({"w0": "s0"}, {"m.safetensors": [1, 2, 3, 4]})]  # as committed, through state.json
    with pytest.raises(ResumeError, match="changed since layer 0 was committed.*tensor w0 in m.safetensors"):
        RankDir(tmp_path, 0, fp).load(lambda reads, files: "tensor w0 in m.safetensors no longer holds ...")


def test_a_rank_one_layer_behind_can_resume_from_the_ones_before(tmp_path: Path):
    """Two layers committed here; a peer committed one: this rank rolls back to 1 and needs layer 1's inputs,
    which the commit of layer 1 must therefore keep (the last two counts' inputs stay)."""
    fp = {"recipe": "r"}
    d = RankDir(tmp_path, 0, fp)
    _commit(d, 0, 1.0)
    _commit(d, 1, 2.0)
    again = RankDir(tmp_path, 0, fp)
    assert again.load() == 2
    again.roll_back(1)
    assert [r.index for r in again.state.layers] == [0]
    assert torch.equal(again.inputs(1)[0].tensors[0], torch.full((2,), 1.0))
    assert not (d.path / "layer00001-r00000-00000.safetensors").exists()
    assert not (d.path / "inputs-00002.safetensors").exists()


def test_ranks_resume_at_the_smallest_committed_count(monkeypatch):
    """A kill between two ranks' commits leaves them one layer apart: every rank resumes at the smaller count;
    two or more apart is not one run's checkpoint."""
    group = SimpleNamespace(world_size=2, device=torch.device("cpu"))

    def peers(counts):
        def all_reduce_max_(t, group):  # what a max all-reduce of [done, -done] over the ranks gives
            t.copy_(torch.stack([torch.tensor([c, -c], dtype=t.dtype) for c in counts]).amax(0))
        monkeypatch.setattr(layerwise, "all_reduce_max_", all_reduce_max_)

    peers([2, 1])
    assert layerwise._agree_on_done(2, group) == 1
    assert layerwise._agree_on_done(1, group) == 1
    peers([3, 3])
    assert layerwise._agree_on_done(3, group) == 3
    peers([3, 1])
    with pytest.raises(ResumeError, match="are 1 and 3 layers in"):
        layerwise._agree_on_done(3, group)


def test_a_field_only_one_of_the_two_fingerprints_has_is_a_difference(tmp_path: Path):
    """A checkpoint written without a field this run fingerprints (or with one it does not) is another run's."""
    _commit(RankDir(tmp_path, 0, {"recipe": "r"}), 0, 1.0)
    with pytest.raises(ResumeError, match="another plan;"):
        RankDir(tmp_path, 0, {"recipe": "r", "plan": "p"}).load()
    with pytest.raises(ResumeError, match="another recipe;"):
        RankDir(tmp_path, 0, {}).load()
