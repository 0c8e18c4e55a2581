"""A checkpoint that ties its embeddings (``tie_word_embeddings: true``, no ``lm_head.weight`` stored) loads and
quantizes as transformers loads it: ``lm_head`` is the embedding, has no tensor of its own to quantize or export,
and the export keeps the tie (issue 42: ``plan_quantization`` raised a RuntimeError on it)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import copy_checkpoint
from safetensors import safe_open

from modelopt_k3.cli.hf_ptq import main as hf_ptq
from modelopt_k3.testing import make_tiny


def _tied(tmp_path: Path) -> Path:
    src = make_tiny("qwen3_moe", tmp_path / "src")
    return copy_checkpoint(src, tmp_path / "tied", drop=["lm_head.weight"],
                           edit_config=lambda c: c.update(tie_word_embeddings=True))


def test_a_tied_lm_head_is_the_embedding_and_is_not_exported(tmp_path: Path) -> None:
    import modelopt_k3

    ckpt = _tied(tmp_path)
    model = modelopt_k3.load_pretrained(ckpt, progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    out = tmp_path / "out"
    assert hf_ptq(["--pyt_ckpt_path", str(ckpt), "--qformat", "nvfp4", "--calib_size", "4", "--calib_seq", "32",
                   "--export_path", str(out), "--no_progress", "--report", "none"]) == 0
    keys = {k for f in out.glob("*.safetensors") for k in safe_open(str(f), "pt").keys()}  # noqa: SIM118
    assert not any(k.startswith("lm_head") for k in keys)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert "model.embed_tokens.weight" in keys

