"""Kimi-K2.5 expert-parallel on 2 gloo ranks (``modelopt-k3-ptq`` as torchrun runs it): each rank reads only its
experts' INT4 bytes, and the calibrated NVFP4 export equals the one-process export byte for byte."""

from __future__ import annotations

import re

import pytest
from _mp import run_ranks

pytestmark = pytest.mark.multiprocess

EP_ENV = {"MODELOPT_K3_DIST_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}
EXPERT_KEY = re.compile(r"\.mlp\.experts\.(?P<expert>\d+)\.")


def _ep_ptq(ckpt: str, out: str):
    """Load expert-parallel (the keys this rank read, its experts), then the CLI run on the same ranks."""
    import modelopt_k3
    from modelopt_k3.dist.group import run_group
    from models.kimi_k25.conftest import ptq

    with run_group():
        model = modelopt_k3.load_pretrained(ckpt, progress=False)
        info = model.modelopt_k3
        read, local = sorted(info.keys_read), info.placement.experts.local
    code = ptq("--pyt_ckpt_path", ckpt, "--export_path", out, "--report", "none", "--target_engines", "vllm")
    return code, read, local


def test_ep2_reads_only_local_experts_and_export_equals_one_process(kimi_k25_ckpt, kimi_k25_export, tmp_path):
    from layerwise.test_layerwise import assert_same_export

    out = tmp_path / "ep2"
    results = run_ranks(2, _ep_ptq, str(kimi_k25_ckpt), str(out), timeout=600, env=EP_ENV)
    assert [r.exitcode for r in results] == [0, 0], [r.traceback for r in results]
    for rank, r in enumerate(results):
        _, keys, local = r.value
        assert local == range(4 * rank, 4 * rank + 4)
        read = {int(m["expert"]) for k in keys if (m := EXPERT_KEY.search(k))}
        assert read == set(local), (rank, sorted(read))  # no rank touched another rank's expert bytes
        assert any(k.endswith(f"experts.{local[0]}.up_proj.weight_packed") for k in keys)
    assert_same_export(kimi_k25_export, out)
