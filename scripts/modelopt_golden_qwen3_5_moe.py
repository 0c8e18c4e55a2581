"""Write tests/data/modelopt_0_47_qwen3_5_moe_golden.json: nvidia-modelopt 0.47.0's NVFP4 experts-only export of
the tiny Qwen3.5-MoE VLM.

NOT run by the tests and not part of the package: it needs a scratch venv with nvidia-modelopt==0.47.0 (the
project never depends on it). Run from the repository root:

    PYTHONPATH=$PWD /path/to/venv-mo/bin/python scripts/modelopt_golden_qwen3_5_moe.py OUT_DIR

It generates ``make_tiny_qwen3_5_moe(seed=0)`` into OUT_DIR/ckpt, loads it with transformers'
``Qwen3_5MoeForConditionalGeneration`` (BF16, ``experts_implementation="eager"``), runs ``mtq.quantize(model,
mtq.NVFP4_EXPERTS_ONLY_CFG, forward_loop)`` on ``calibration_token_ids()`` (one batch: ModelOpt's experts-only
config names Qwen3.5's gated delta net, shared-expert gate, MTP and vision tower as kept), ``export_hf_checkpoint``
into OUT_DIR/export, and records every exported tensor (sha256, dtype, shape; scalar scales also as
``float.hex``) plus hf_quant_config.json.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def record_tensors(export: Path) -> dict[str, dict]:
    """Every tensor of the export: dtype, shape, sha256 of its bytes, one-element floats also as float.hex()."""
    tensors: dict[str, dict] = {}
    for shard in sorted(export.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                t = f.get_tensor(key)
                row = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": _sha(t)}
                if t.numel() == 1 and t.is_floating_point():
                    row["value"] = t.float().item().hex()
                tensors[key] = row
    return tensors


def main(out: Path) -> None:
    import modelopt
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import Qwen3_5MoeForConditionalGeneration

    from modelopt_k3.testing.qwen3_5_moe import calibration_token_ids, make_tiny_qwen3_5_moe

    ckpt = make_tiny_qwen3_5_moe(out / "ckpt", seed=0, overwrite=True)
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(ckpt, dtype=torch.bfloat16,
                                                               experts_implementation="eager")
    model.eval()
    ids = calibration_token_ids()

    def forward_loop(m):
        with torch.no_grad():
            m(input_ids=ids)

    mtq.quantize(model, mtq.NVFP4_EXPERTS_ONLY_CFG, forward_loop)
    export = out / "export"
    export_hf_checkpoint(model, export_dir=str(export))

    tensors = record_tensors(export)
    golden = {
        "_about": (
            f"nvidia-modelopt {modelopt.__version__} (PyPI), transformers {transformers.__version__}, torch "
            f"{torch.__version__}, CPU: mtq.quantize(NVFP4_EXPERTS_ONLY_CFG) with one forward of "
            "modelopt_k3.testing.qwen3_5_moe.calibration_token_ids() + export_hf_checkpoint of "
            "make_tiny_qwen3_5_moe(seed=0) loaded by Qwen3_5MoeForConditionalGeneration (bf16, eager experts). "
            "Written by scripts/modelopt_golden_qwen3_5_moe.py."
        ),
        "hf_quant_config": json.loads((export / "hf_quant_config.json").read_text()),
        "tensors": dict(sorted(tensors.items())),
    }
    dest = Path(__file__).resolve().parents[1] / "tests" / "data" / "modelopt_0_47_qwen3_5_moe_golden.json"
    dest.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"wrote {dest}: {len(tensors)} tensors")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
