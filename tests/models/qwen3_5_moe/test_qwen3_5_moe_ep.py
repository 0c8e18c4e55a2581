"""Qwen3.5-MoE expert-parallel on 2 gloo ranks: each rank reads only its experts' byte ranges of the fused
``[E, 2I, H]`` / ``[E, H, I]`` tensors, logits equal one process, and the calibrated NVFP4 export equals the
one-process export tensor for tensor, byte for byte."""

from __future__ import annotations

import json
import re

import pytest
import torch
from _exports import read_export
from _mp import run_ranks

pytestmark = pytest.mark.multiprocess

EP_ENV = {"MODELOPT_K3_DIST_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}
EXPERT_KEY = re.compile(r"^model\.language_model\.layers\.\d+\.mlp\.experts\.(?P<expert>\d+)\.")
RECIPE = "models/Qwen/Qwen3.5-MoE/nvfp4"


def _ep_run(ckpt: str, out: str):
    """Load expert-parallel, logits on the calibration ids, calibrate on this rank's half of them, export."""
    import modelopt_k3
    from modelopt_k3.dist.group import run_group
    from modelopt_k3.testing.qwen3_5_moe import calibration_token_ids

    with run_group() as group:
        model = modelopt_k3.load_pretrained(ckpt, progress=False)
        info = model.modelopt_k3
        ids = calibration_token_ids()
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        share = ids.chunk(group.world_size)[group.rank]  # every rank one forward: all-to-all is collective

        def loop(m):
            with torch.no_grad():
                m(input_ids=share)

        modelopt_k3.quantize(model, RECIPE, loop, verbose=False)
        modelopt_k3.export_checkpoint(model, out, progress=False)
        return logits, sorted(info.keys_read), info.plan.kind, info.placement.experts.local


def test_ep2_reads_only_local_experts_and_export_equals_one_process(qwen3_5_moe_ckpt, qwen3_5_moe_export, tmp_path):
    from modelopt_k3 import load_pretrained
    from modelopt_k3.testing.qwen3_5_moe import calibration_token_ids

    out = tmp_path / "ep2"
    results = run_ranks(2, _ep_run, str(qwen3_5_moe_ckpt), str(out), timeout=600, env=EP_ENV)
    assert [r.exitcode for r in results] == [0, 0], [r.traceback for r in results]
    single = load_pretrained(qwen3_5_moe_ckpt, progress=False)
    with torch.no_grad():
        ref = single(input_ids=calibration_token_ids()).logits
    for rank, r in enumerate(results):
        logits, keys, kind, local = r.value
        assert kind == "expert_parallel" and local == range(4 * rank, 4 * rank + 4)
        assert torch.equal(logits, ref), rank
        read = {int(m["expert"]) for k in keys if (m := EXPERT_KEY.search(k))}
        assert read == set(local), (rank, sorted(read))  # no rank touched another rank's expert bytes
        assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)  # never whole
    ours, theirs = read_export(out), read_export(qwen3_5_moe_export)
    assert set(ours) == set(theirs)
    for key, t in theirs.items():
        assert ours[key].dtype == t.dtype and torch.equal(ours[key].reshape(-1).view(torch.uint8),
                                                          t.reshape(-1).view(torch.uint8)), key
    for name in ("config.json", "hf_quant_config.json"):
        assert json.loads((out / name).read_text()) == json.loads((qwen3_5_moe_export / name).read_text()), name
