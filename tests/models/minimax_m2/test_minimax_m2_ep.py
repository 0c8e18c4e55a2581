"""MiniMax-M2 expert-parallel on 2 gloo ranks: each rank reads only its experts' bytes (block-FP8 codes and
scales), logits equal one process, and the calibrated NVFP4 export equals the one-process export byte for byte."""

from __future__ import annotations

import json
import re

import pytest
import torch
from _exports import read_export
from _mp import run_ranks

pytestmark = pytest.mark.multiprocess

EP_ENV = {"MODELOPT_K3_DIST_TIMEOUT": "30", "OMP_NUM_THREADS": "1"}
EXPERT_KEY = re.compile(r"\.block_sparse_moe\.experts\.(?P<expert>\d+)\.")
RECIPE = "models/MiniMaxAI/MiniMax-M2/nvfp4"


def _run(ckpt: str, out: str):
    """Load (expert-parallel under a run group of 2), logits, calibrate on this rank's share, export."""
    import modelopt_k3
    from modelopt_k3.dist.group import run_group
    from modelopt_k3.testing.minimax_m2 import calibration_token_ids

    with run_group() as group:
        model = modelopt_k3.load_pretrained(ckpt, progress=False)
        info = model.modelopt_k3
        ids = calibration_token_ids()
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        share = ids.chunk(group.world_size)[group.rank]

        def loop(m):
            with torch.no_grad():
                m(input_ids=share)

        modelopt_k3.quantize(model, RECIPE, loop, verbose=False)
        modelopt_k3.export_checkpoint(model, out, progress=False)
        return logits, sorted(info.keys_read), info.plan.kind, info.placement.experts.local


def test_ep2_reads_only_local_experts_and_export_equals_one_process(minimax_m2_ckpt, tmp_path):
    single = run_ranks(1, _run, str(minimax_m2_ckpt), str(tmp_path / "single"), timeout=300, env=EP_ENV)
    results = run_ranks(2, _run, str(minimax_m2_ckpt), str(tmp_path / "ep2"), timeout=300, env=EP_ENV)
    assert [r.exitcode for r in single + results] == [0, 0, 0], [r.traceback for r in single + results]
    ref, *_ = single[0].value
    for rank, r in enumerate(results):
        logits, keys, kind, local = r.value
        assert kind == "expert_parallel" and local == range(4 * rank, 4 * rank + 4)
        assert torch.equal(logits, ref), rank
        read = {int(m["expert"]) for k in keys if (m := EXPERT_KEY.search(k))}
        assert read == set(local), (rank, sorted(read))  # no rank touched another rank's expert bytes
        assert any(k.endswith("w1.weight_scale_inv") for k in keys)
    ours, theirs = read_export(tmp_path / "ep2"), read_export(tmp_path / "single")
    assert set(ours) == set(theirs)
    for key, t in theirs.items():
        assert ours[key].dtype == t.dtype and torch.equal(ours[key].reshape(-1).view(torch.uint8),
                                                          t.reshape(-1).view(torch.uint8)), key
    for name in ("config.json", "hf_quant_config.json"):
        assert json.loads((tmp_path / "ep2" / name).read_text()) == json.loads((tmp_path / "single" / name).read_text())
