"""Kimi-K2.5 expert-parallel on 2 gloo ranks (``modelopt-k3-ptq`` as torchrun runs it): each rank reads only its
experts' INT4 bytes, and the calibrated NVFP4 export equals the one-process export byte for byte."""

from __future__ import annotations

import re

import pytest
from _mp import run_ranks

pytestmark = pytest.mark.multiprocess

# A long timeout: the two ranks build transformers' classes on a shared, loaded CPU.
EP_ENV = {"MODELOPT_K3_DIST_TIMEOUT": "300", "OMP_NUM_THREADS": "1"}
EXPERT_KEY = re.compile(r"\.mlp\.experts\.(?P<expert>\d+)\.")


def _ep_load(ckpt: str):
    """Load expert-parallel: the keys this rank read and its experts."""
    import modelopt_k3
    from modelopt_k3.dist.group import run_group

    with run_group():
        info = modelopt_k3.load_pretrained(ckpt, progress=False).modelopt_k3
        return sorted(info.keys_read), info.placement.experts.local


def _ep_ptq(ckpt: str, out: str) -> int:
    """The CLI run, as torchrun starts it on each rank."""
    from models.kimi_k25.conftest import ptq

    return ptq("--pyt_ckpt_path", ckpt, "--export_path", out, "--report", "none", "--target_engines", "vllm")


def test_ep2_reads_only_local_experts_and_export_equals_one_process(kimi_k25_ckpt, kimi_k25_export, tmp_path):
    from layerwise.test_layerwise import assert_same_export

    loads = run_ranks(2, _ep_load, str(kimi_k25_ckpt), timeout=600, env=EP_ENV)
    assert [r.exitcode for r in loads] == [0, 0], [r.traceback for r in loads]
    for rank, r in enumerate(loads):
        keys, local = r.value
        assert local == range(4 * rank, 4 * rank + 4)
        read = {int(m["expert"]) for k in keys if (m := EXPERT_KEY.search(k))}
        assert read == set(local), (rank, sorted(read))  # no rank touched another rank's expert bytes
        assert any(k.endswith(f"experts.{local[0]}.up_proj.weight_packed") for k in keys)
    out = tmp_path / "ep2"
    runs = run_ranks(2, _ep_ptq, str(kimi_k25_ckpt), str(out), timeout=600, env=EP_ENV)
    assert [r.exitcode for r in runs] == [0, 0], [r.traceback for r in runs]
    assert_same_export(kimi_k25_export, out)
