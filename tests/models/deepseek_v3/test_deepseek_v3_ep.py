"""DeepSeek-V3 (block-FP8 source) expert-parallel on 2 gloo ranks: each rank reads only its experts' bytes
(codes and scales), logits equal one process, and the calibrated NVFP4 export equals the one-process export
tensor for tensor, byte for byte, and ModelOpt 0.47's (test_modelopt_golden.py)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from _exports import read_export
from _mp import run_ranks

from models.deepseek_v3.test_modelopt_golden import assert_equals_modelopt_golden

pytestmark = pytest.mark.multiprocess

EP_ENV = {"MODELOPT_K3_DIST_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}
EXPERT_KEY = re.compile(r"\.mlp\.experts\.(?P<expert>\d+)\.")
RECIPE = "models/deepseek-ai/DeepSeek-V3/nvfp4"


def _ep_run(ckpt: str, out: str):
    """Load expert-parallel, logits on the calibration ids, calibrate on this rank's half of them, export."""
    import modelopt_k3
    from modelopt_k3.dist.group import run_group
    from modelopt_k3.testing.deepseek_v3 import calibration_token_ids

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




def test_ep2_reads_only_local_experts_and_export_equals_one_process(deepseek_fp8_ckpt, deepseek_fp8_export, tmp_path):
    from modelopt_k3 import load_pretrained
    from modelopt_k3.testing.deepseek_v3 import calibration_token_ids

    out = tmp_path / "ep2"
    results = run_ranks(2, _ep_run, str(deepseek_fp8_ckpt), str(out), timeout=600, env=EP_ENV)
    assert [r.exitcode for r in results] == [0, 0], [r.traceback for r in results]
    single = load_pretrained(deepseek_fp8_ckpt, progress=False)
    with torch.no_grad():
        ref = single(input_ids=calibration_token_ids()).logits
    for rank, r in enumerate(results):
        logits, keys, kind, local = r.value
        assert kind == "expert_parallel" and local == range(4 * rank, 4 * rank + 4)
        assert torch.equal(logits, ref), rank
        read = {int(m["expert"]) for k in keys if (m := EXPERT_KEY.search(k))}
        assert read == set(local), (rank, sorted(read))  # no rank touched another rank's expert bytes
        assert any(k.endswith(f"experts.{local[0]}.up_proj.weight_scale_inv") for k in keys)
    ours, theirs = read_export(out), read_export(deepseek_fp8_export)
    assert set(ours) == set(theirs)
    for key, t in theirs.items():
        assert ours[key].dtype == t.dtype and torch.equal(ours[key].reshape(-1).view(torch.uint8),
                                                          t.reshape(-1).view(torch.uint8)), key
    for name in ("config.json", "hf_quant_config.json"):
        assert json.loads((out / name).read_text()) == json.loads((deepseek_fp8_export / name).read_text()), name
    assert_equals_modelopt_golden(out)  # and so ModelOpt 0.47's one-process export (routers by value)


def _ep_load(ckpt: str):
    """Load expert-parallel; the logits on the calibration ids and the keys this rank read."""
    import modelopt_k3
    from modelopt_k3.dist.group import run_group
    from modelopt_k3.testing.deepseek_v3 import calibration_token_ids

    with run_group():
        model = modelopt_k3.load_pretrained(ckpt, progress=False)
        with torch.no_grad():
            logits = model(input_ids=calibration_token_ids()).logits
        return logits, sorted(model.modelopt_k3.keys_read), model.modelopt_k3.placement.experts.local


def test_ep2_int4_experts_read_only_local_codes_scales_and_shapes(deepseek_int4_ckpt):
    """Kimi-K2.5-style INT4 pack-quantized experts at EP 2: each rank reads only its experts' weight_packed,
    weight_scale and weight_shape, and its logits equal one process's."""
    from modelopt_k3 import load_pretrained
    from modelopt_k3.testing.deepseek_v3 import calibration_token_ids

    results = run_ranks(2, _ep_load, str(deepseek_int4_ckpt), timeout=600, env=EP_ENV)
    assert [r.exitcode for r in results] == [0, 0], [r.traceback for r in results]
    with torch.no_grad():
        ref = load_pretrained(deepseek_int4_ckpt, progress=False)(input_ids=calibration_token_ids()).logits
    for rank, r in enumerate(results):
        logits, keys, local = r.value
        assert torch.equal(logits, ref), rank
        read = {int(m["expert"]) for k in keys if (m := EXPERT_KEY.search(k))}
        assert read == set(local) and len(local) == 4, (rank, sorted(read))
        for field in ("weight_packed", "weight_scale", "weight_shape"):
            assert any(k.endswith(f"experts.{local[-1]}.down_proj.{field}") for k in keys), (rank, field)


def _ep_weight_only(ckpt: str, out: str):
    import modelopt_k3
    from modelopt_k3.dist.group import run_group

    with run_group():
        model = modelopt_k3.load_pretrained(ckpt, progress=False)
        modelopt_k3.quantize(model, "models/deepseek-ai/DeepSeek-V3/w4a16_nvfp4", None, verbose=False)
        modelopt_k3.export_checkpoint(model, out, progress=False)
        return model.modelopt_k3.plan.kind


def test_ep2_carries_the_mtp_layer_as_one_process(deepseek_mtp_ckpts, tmp_path):
    """EP 2 on the stand-in with an MTP layer (weight-only, no calibration): the carried layer's items are split
    over the ranks like dense items; the export equals one process's byte for byte."""
    from .conftest import weight_only_export

    ckpt = deepseek_mtp_ckpts["block_fp8"]
    out = tmp_path / "ep2"
    results = run_ranks(2, _ep_weight_only, str(ckpt), str(out), timeout=600, env=EP_ENV)
    assert [r.exitcode for r in results] == [0, 0], [r.traceback for r in results]
    assert [r.value for r in results] == ["expert_parallel"] * 2
    one = weight_only_export(ckpt, tmp_path / "one")
    ours, theirs = read_export(out), read_export(one)
    assert set(ours) == set(theirs) and any(k.startswith("model.layers.3.mlp.experts.") for k in ours)
    for key, t in theirs.items():
        assert ours[key].dtype == t.dtype and torch.equal(ours[key].reshape(-1).view(torch.uint8),
                                                          t.reshape(-1).view(torch.uint8)), key
    for name in ("config.json", "hf_quant_config.json"):
        assert json.loads((out / name).read_text()) == json.loads((one / name).read_text()), name
