"""Write tests/data/modelopt_0_47_nemotron_h_golden.json: nvidia-modelopt 0.47.0's NVFP4 export of the tiny
Nemotron-H (routed experts only: ``NVFP4_EXPERTS_ONLY_CFG``, what ``models/nvidia/Nemotron-3/nvfp4_experts``
quantizes).

NOT run by the tests and not part of the package: it needs nvidia-modelopt==0.47.0 importable (a scratch venv, or
the wheel unpacked with its missing pure-Python deps on PYTHONPATH; the project never depends on it). From the
repository root:

    PYTHONPATH=$PWD:/path/to/modelopt-0.47 python scripts/modelopt_golden_nemotron_h.py OUT_DIR

It generates ``make_tiny_nemotron_h(seed=0, moe_latent_size=48)`` (the tests' stand-in) into OUT_DIR/ckpt, loads
it with transformers' ``AutoModelForCausalLM`` (BF16, ``experts_implementation="eager"``), runs
``mtq.quantize(model, mtq.NVFP4_EXPERTS_ONLY_CFG, forward_loop)`` on one batch of
``calibration_token_ids(num=4, seq=32)``, ``export_hf_checkpoint`` into OUT_DIR/export, and records every exported
tensor as ``scripts/modelopt_golden_qwen3_moe.py`` does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from modelopt_golden_qwen3_moe import record_tensors  # noqa: E402


def main(out: Path) -> None:
    import modelopt
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    from modelopt_k3.testing.nemotron_h import calibration_token_ids, make_tiny_nemotron_h

    ckpt = make_tiny_nemotron_h(out / "ckpt", seed=0, overwrite=True, moe_latent_size=48)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, experts_implementation="eager")
    model.eval()
    ids = calibration_token_ids(num=4, seq=32)

    def forward_loop(m):
        with torch.no_grad():
            m(input_ids=ids)

    mtq.quantize(model, mtq.NVFP4_EXPERTS_ONLY_CFG, forward_loop)
    export = out / "export"
    export_hf_checkpoint(model, export_dir=str(export))

    tensors = record_tensors(export)
    golden = {
        "_about": (
            f"nvidia-modelopt {modelopt.__version__} (PyPI wheel), transformers {transformers.__version__}, torch "
            f"{torch.__version__}, CPU: mtq.quantize(NVFP4_EXPERTS_ONLY_CFG) with one forward of "
            "modelopt_k3.testing.nemotron_h.calibration_token_ids(num=4, seq=32) + export_hf_checkpoint of "
            "make_tiny_nemotron_h(seed=0, moe_latent_size=48) loaded by AutoModelForCausalLM (bf16, "
            "experts_implementation=eager). Written by scripts/modelopt_golden_nemotron_h.py."
        ),
        "hf_quant_config": json.loads((export / "hf_quant_config.json").read_text()),
        "config_quantization_config": json.loads((export / "config.json").read_text()).get("quantization_config"),
        "tensors": dict(sorted(tensors.items())),
    }
    dest = Path(__file__).resolve().parents[1] / "tests" / "data" / "modelopt_0_47_nemotron_h_golden.json"
    dest.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"wrote {dest}: {len(tensors)} tensors")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
