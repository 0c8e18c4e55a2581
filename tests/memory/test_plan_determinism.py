"""The layerwise plan names the same largest layer in every process: of equally large decoder layers (the tiny
DeepSeek-V3's two MoE layers) the first in checkpoint order, whatever PYTHONHASHSEED orders a set by."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SEEDS = ("0", "1", "2", "3", "5")


def _plan(ckpt: Path, seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    cmd = [sys.executable, "-m", "modelopt_k3.cli.plan", "--pyt_ckpt_path", str(ckpt), "--world_size", "1",
           "--layerwise", "--device", "cpu", "--gpu_mem_gib", "64", "--batch_size", "1", "--calib_seq", "64"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode in (0, 1), done.stderr
    return done.stdout


def test_layerwise_plan_is_the_same_under_every_hash_seed(tmp_path: Path) -> None:
    from modelopt_k3.testing.deepseek_v3 import make_tiny_deepseek_v3

    ckpt = make_tiny_deepseek_v3(tmp_path / "dsv3")
    plans = {seed: _plan(ckpt, seed) for seed in SEEDS}
    assert "model.layers.1 (the largest layer)" in plans["0"], plans["0"]
    assert len(set(plans.values())) == 1, plans
