"""Write tests/data/modelopt_0_47_glm_moe_dsa_golden.json: nvidia-modelopt 0.47.0's NVFP4 export of the tiny GLM-5.

NOT run by the tests and not part of the package: it needs a scratch venv with nvidia-modelopt==0.47.0 (the
project never depends on it; ``python -m venv --system-site-packages V && V/bin/pip install
nvidia-modelopt==0.47.0`` over this machine's torch and transformers). Run from the repository root:

    PYTHONPATH=$PWD /path/to/venv/bin/python scripts/modelopt_golden_glm_moe_dsa.py OUT_DIR

As ``modelopt_golden_qwen3_moe.py`` (its ``record_tensors``), on ``make_tiny_glm_moe_dsa(seed=0)``: transformers'
``AutoModelForCausalLM`` (BF16, eager experts; the MTP layer is not loaded), ``mtq.quantize(model,
mtq.NVFP4_DEFAULT_CFG, forward_loop)`` on ``calibration_token_ids()`` (one batch), ``export_hf_checkpoint``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from modelopt_golden_qwen3_moe import record_tensors


def main(out: Path) -> None:
    import modelopt
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    from modelopt_k3.testing.glm_moe_dsa import calibration_token_ids, make_tiny_glm_moe_dsa

    ckpt = make_tiny_glm_moe_dsa(out / "ckpt", seed=0, overwrite=True)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, experts_implementation="eager").eval()
    ids = calibration_token_ids()

    def forward_loop(m):
        with torch.no_grad():
            m(input_ids=ids)

    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)
    export = out / "export"
    export_hf_checkpoint(model, export_dir=str(export))
    tensors = record_tensors(export)
    golden = {
        "_about": (
            f"nvidia-modelopt {modelopt.__version__} (PyPI), transformers {transformers.__version__}, torch "
            f"{torch.__version__}, CPU: mtq.quantize(NVFP4_DEFAULT_CFG) with one forward of "
            "modelopt_k3.testing.glm_moe_dsa.calibration_token_ids() + export_hf_checkpoint of "
            "make_tiny_glm_moe_dsa(seed=0) loaded by AutoModelForCausalLM (bf16, experts_implementation=eager). "
            "Written by scripts/modelopt_golden_glm_moe_dsa.py."
        ),
        "hf_quant_config": json.loads((export / "hf_quant_config.json").read_text()),
        "config_quantization_config": json.loads((export / "config.json").read_text()).get("quantization_config"),
        "tensors": dict(sorted(tensors.items())),
    }
    dest = Path(__file__).resolve().parents[1] / "tests" / "data" / "modelopt_0_47_glm_moe_dsa_golden.json"
    dest.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"wrote {dest}: {len(tensors)} tensors")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
