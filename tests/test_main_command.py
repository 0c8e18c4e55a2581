"""The README's main job, literally: torchrun, 2 ranks, the embedded tiny Kimi-K3, NVFP4 export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _mp import free_port

from modelopt_k3.testing import generator_fingerprint

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.multiprocess


def test_readme_main_command(tmp_path):
    out = tmp_path / "out-nvfp4"
    env = {**os.environ, "MODELOPT_K3_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(REPO / "examples/hf_ptq.py"), "--qformat", "nvfp4", "--export_path", str(out), "--no_progress"]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "plan=expert_parallel world=2" in proc.stdout
    assert "[modelopt_k3] exported" in proc.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert all((out / f).is_file() for f in set(index.values()))
    assert any(k.endswith("experts.7.w1.weight_scale_2") for k in index)
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["quant_algo"] == "NVFP4"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    assert (tmp_path / "cache" / f"tiny_kimi_k3-{generator_fingerprint()}" / "model.safetensors.index.json").exists()
