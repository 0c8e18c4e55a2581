"""Layerwise under expert parallelism (gloo, two ranks): each rank reads only its own experts' bytes, and the
export equals the one-process resident export byte for byte, bf16 and packed experts."""

from __future__ import annotations

from pathlib import Path

import pytest
from _mp import run_ranks

from layerwise.test_layerwise import PTQ, assert_same_export

pytestmark = pytest.mark.multiprocess

ENV = {"MODELOPT_K3_DIST_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}


def _ptq(argv: list[str]):
    from modelopt_k3.cli import hf_ptq

    return hf_ptq.run(hf_ptq.build_parser().parse_args([*PTQ, *argv]))


def _keys_read(argv: list[str]):
    """A layerwise run, recording every source key this rank read (the reader's log, at the end)."""
    from modelopt_k3.load import LayerwiseLoad

    seen: list[list[str]] = []
    finish = LayerwiseLoad.finish

    def recording(self):
        seen.append(list(self.reader.log.keys))
        return finish(self)

    LayerwiseLoad.finish = recording
    _ptq(argv)
    return seen[0]


def test_ep2_layerwise_equals_the_single_process_resident_export(tmp_path: Path):
    from modelopt_k3.models.kimi_k3.converters import EXPERT_KEY_RE
    from modelopt_k3.testing import make_tiny_kimi_k3

    ckpt = make_tiny_kimi_k3(tmp_path / "src", num_experts=16)
    base = ["--pyt_ckpt_path", str(ckpt), "--trust_remote_code", "--kv_cache_qformat", "fp8"]
    (r,) = run_ranks(1, _ptq, [*base, "--export_path", str(tmp_path / "single"), "--experts", "bf16", "--report",
                                "none"], timeout=300, env=ENV)
    assert r.exitcode == 0, r.traceback
    for experts in ("bf16", "packed"):
        out = tmp_path / f"ep2-{experts}"
        results = run_ranks(2, _keys_read, [*base, "--export_path", str(out), "--experts", experts, "--layerwise"],
                            timeout=300, env=ENV)
        assert [x.exitcode for x in results] == [0, 0], [x.traceback for x in results]
        assert_same_export(tmp_path / "single", out)
        expert_keys = [[k for k in x.value if EXPERT_KEY_RE.match(k)] for x in results]
        if experts == "packed":  # bf16 experts re-read their MXFP4 bytes for the export's lossless cast, as resident
            assert all(len(keys) == len(set(keys)) for keys in expert_keys), "a source tensor was read twice"
        assert not set(expert_keys[0]) & set(expert_keys[1]), "two ranks read the same expert"
        ids = [{int(EXPERT_KEY_RE.match(k)["expert"]) for k in keys} for keys in expert_keys]
        assert ids == [set(range(8)), set(range(8, 16))]  # each rank its own EP block, every expert once


@pytest.mark.parametrize("model", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_ep2_layerwise_equals_single_process_for_the_other_models(model, tmp_path: Path):
    from layerwise.test_layerwise import MODELS

    ckpt = MODELS[model](tmp_path / "src")
    base = ["--pyt_ckpt_path", str(ckpt), "--trust_remote_code"]
    (r,) = run_ranks(1, _ptq, [*base, "--export_path", str(tmp_path / "single"), "--report", "none"], timeout=300,
                     env=ENV)
    assert r.exitcode == 0, r.traceback
    results = run_ranks(2, _ptq, [*base, "--export_path", str(tmp_path / "ep2"), "--layerwise"], timeout=300, env=ENV)
    assert [x.exitcode for x in results] == [0, 0], [x.traceback for x in results]
    assert_same_export(tmp_path / "single", tmp_path / "ep2")
