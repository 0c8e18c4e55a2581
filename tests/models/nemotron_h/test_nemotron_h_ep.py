"""Nemotron-H through the other paths: expert-parallel on 2 gloo ranks (each rank reads only its experts' bytes,
logits equal one process, the export equals the one-process export byte for byte) and layerwise (decoder layers of
three kinds, Mamba-2 included, replayed one at a time: the export equals the resident one)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from _exports import read_export
from _mp import run_ranks

from .conftest import RECIPE, calibration_ids

EP_ENV = {"MODELOPT_K3_DIST_TIMEOUT": "30", "OMP_NUM_THREADS": "1"}
EXPERT_KEY = re.compile(r"\.mixer\.experts\.(?P<expert>\d+)\.")


def _same_export(a: Path, b: Path) -> None:
    ta, tb = read_export(a), read_export(b)
    assert set(ta) == set(tb), sorted(set(ta) ^ set(tb))[:10]
    differ = [k for k in ta if ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape
              or not torch.equal(ta[k].reshape(-1).view(torch.uint8), tb[k].reshape(-1).view(torch.uint8))]
    assert differ == [], differ[:10]
    for name in ("config.json", "hf_quant_config.json"):
        assert json.loads((a / name).read_text()) == json.loads((b / name).read_text()), name


def _ep_run(ckpt: str, out: str):
    """Load expert-parallel, logits on the calibration ids, calibrate on this rank's half of them, export."""
    import modelopt_k3
    from modelopt_k3.dist.group import run_group

    with run_group() as group:
        model = modelopt_k3.load_pretrained(ckpt, progress=False)
        info = model.modelopt_k3
        ids = calibration_ids()
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        share = ids.chunk(group.world_size)[group.rank]

        def loop(m):
            with torch.no_grad():
                m(input_ids=share)

        modelopt_k3.quantize(model, RECIPE, loop, verbose=False)
        modelopt_k3.export_checkpoint(model, out, progress=False)
        return logits, sorted(info.keys_read), info.plan.kind, info.placement.experts.local


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ep2_reads_only_local_experts_and_export_equals_one_process(nemotron_h_ckpt, nemotron_h_export, tmp_path):
    from modelopt_k3 import load_pretrained

    out = tmp_path / "ep2"
    results = run_ranks(2, _ep_run, str(nemotron_h_ckpt), str(out), timeout=300, env=EP_ENV)
    assert [r.exitcode for r in results] == [0, 0], [r.traceback for r in results]
    with torch.no_grad():
        ref = load_pretrained(nemotron_h_ckpt, progress=False)(input_ids=calibration_ids()).logits
    for rank, r in enumerate(results):
        logits, keys, kind, local = r.value
        assert kind == "expert_parallel" and local == range(4 * rank, 4 * rank + 4)
        assert torch.equal(logits, ref), rank
        # The decoder's experts: this rank's only; the MTP block's are carried, read by no load.
        read = {int(m["expert"]) for k in keys if (m := EXPERT_KEY.search(k))}
        assert read == set(local), (rank, sorted(read))
        assert not [k for k in keys if k.startswith("mtp.")], rank
    _same_export(out, nemotron_h_export)


def ptq(*argv) -> int:
    from modelopt_k3.cli import hf_ptq

    flags = ["--qformat", "nvfp4", "--calib_size", "4", "--batch_size", "2", "--calib_seq", "24", "--no_progress",
             "--report", "none"]
    return hf_ptq.run(hf_ptq.build_parser().parse_args([*flags, *map(str, argv)]))


@pytest.mark.slow
def test_layerwise_export_equals_the_resident_export(nemotron_h_ckpt, tmp_path: Path):
    """``--qformat nvfp4`` resolves to the Nemotron-3 recipe; Mamba-2, MoE and attention layers replayed one by one."""
    assert ptq("--pyt_ckpt_path", nemotron_h_ckpt, "--export_path", tmp_path / "resident") == 0
    assert ptq("--pyt_ckpt_path", nemotron_h_ckpt, "--export_path", tmp_path / "layerwise", "--layerwise") == 0
    _same_export(tmp_path / "resident", tmp_path / "layerwise")
    recipe = json.loads((tmp_path / "layerwise" / "hf_quant_config.json").read_text())["modelopt_k3"]["recipe"]
    assert recipe == RECIPE
