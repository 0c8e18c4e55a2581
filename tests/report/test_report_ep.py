"""Expert parallelism: the report of an EP 2 / EP 4 run equals the 1-process report of the same job.

Each rank contributes only what it owns (its experts' rows, its dense share, its tokens' counts); rank 0
merges. Fields that say how the run was split (world size, plan, tokens by rank) differ by construction;
everything else must agree: counts exactly, floats to float64 summation order.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _mp import run_ranks

pytestmark = pytest.mark.multiprocess

EP_ENV = {"MODELOPT_K3_DIST_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}
SPLIT_FIELDS = {("run", "world_size"), ("run", "plan")}


def _ptq(argv: list[str]) -> int:
    from modelopt_k3.cli import hf_ptq

    return hf_ptq.run(hf_ptq.build_parser().parse_args(argv))


def _run(n: int, ckpt: Path, out: Path) -> dict:
    argv = ["--pyt_ckpt_path", str(ckpt), "--trust_remote_code", "--export_path", str(out), "--calib_size", "8",
            "--calib_seq", "32", "--batch_size", "1", "--report_heldout", "4", "--uncovered_experts", "shared",
            "--no_progress"]
    results = run_ranks(n, _ptq, argv, timeout=600, env=EP_ENV)
    assert [r.exitcode for r in results] == [0] * n, [(r.error, r.traceback) for r in results]
    return json.loads((out / "quant_report" / "report.json").read_text())


def _split_by_rank(data: dict) -> list[list[list[int]]]:
    return [layer.pop("routed_by_rank") for layer in data["coverage"]["layers"]]


def _diff(a, b, path=()) -> list[str]:
    if path[:2] in SPLIT_FIELDS:
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{'.'.join(map(str, path))}: keys {sorted(a.keys() ^ b.keys())}"]
        return [d for k in a for d in _diff(a[k], b[k], (*path, k))]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{'.'.join(map(str, path))}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, (*path, i))]
    if isinstance(a, float) and isinstance(b, float):
        return [] if math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) else [f"{'.'.join(map(str, path))}: {a} != {b}"]
    return [] if a == b and type(a) is type(b) else [f"{'.'.join(map(str, path))}: {a!r} != {b!r}"]


@pytest.fixture(scope="module")
def starved_ckpt(tiny_ckpt, tmp_path_factory) -> Path:
    from conftest import copy_checkpoint
    from safetensors import safe_open

    key = "language_model.model.layers.2.block_sparse_moe.gate.e_score_correction_bias"
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(tiny_ckpt / index[key]), framework="pt") as f:
        bias = f.get_tensor(key).clone()
    bias[5] = -1e4
    return copy_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("starved") / "ckpt", replace={key: bias})


@pytest.fixture(scope="module")
def one_process(starved_ckpt, tmp_path_factory) -> dict:
    return _run(1, starved_ckpt, tmp_path_factory.mktemp("ep1") / "export")


@pytest.mark.parametrize("ep", [2, 4])
def test_ep_report_equals_one_process(ep, starved_ckpt, one_process, tmp_path):
    data = _run(ep, starved_ckpt, tmp_path / "export")
    assert data["run"]["world_size"] == ep and "ep=" + str(ep) in data["run"]["plan"]
    reference = json.loads(json.dumps(one_process))
    by_rank, ref_by_rank = _split_by_rank(data), _split_by_rank(reference)
    for layer, ranks in zip(data["coverage"]["layers"], by_rank):
        assert len(ranks) == ep and torch.tensor(ranks).sum(0).tolist() == layer["routed"]
    assert all(len(r) == 1 for r in ref_by_rank)
    differences = _diff(reference, data)
    assert not differences, differences[:20]
    starved = next(layer for layer in data["coverage"]["layers"] if ".layers.2." in layer["module"])
    assert [u["expert"] for u in starved["uncovered"]] == [5]
