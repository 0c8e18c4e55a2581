"""Write tests/data/modelopt_0_47_qwen3_moe_outliers_<algorithm>_golden.json: nvidia-modelopt 0.47.0's NVFP4
export of the tiny Qwen3-MoE outlier stand-in for each weight algorithm of issue 29.

NOT run by the tests and not part of the package. It needs a CUDA machine (ModelOpt's static-NVFP4 fake quant,
which every algorithm but max uses, is a Triton kernel: ``static_blockwise_fp4_fake_quant requires triton``) and
a scratch venv with ``nvidia-modelopt==0.47.0``, ``triton`` and the transformers this project pins (the project
never depends on ModelOpt). From the repository root:

    PYTHONPATH=$PWD /path/to/venv-mo/bin/python scripts/modelopt_golden_calibrators.py OUT_DIR [ALGORITHM ...]

For each algorithm it generates ``make_tiny_qwen3_moe(seed=0, outliers=True)`` (heavy-tailed activations: the
data on which the algorithms disagree with max), loads it with transformers' ``AutoModelForCausalLM`` (BF16,
``experts_implementation="eager"``, as ``modelopt_golden_qwen3_moe.py``), runs ``mtq.quantize`` with ModelOpt's
own configuration of that algorithm on one forward of ``calibration_token_ids()``, ``export_hf_checkpoint`` and
records every tensor as the max golden does. The configurations, by ModelOpt's names:

- ``mse``: ``NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG`` (our ``--qformat nvfp4_mse``);
- ``four_over_six``: ``NVFP4_FOUR_OVER_SIX_CFG`` (``nvfp4_four_over_six``);
- ``local_hessian``: ``NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG`` (``nvfp4_local_hessian``);
- ``gptq``: the recipe ``general/ptq/nvfp4_default-kv_none-gptq`` (``nvfp4_gptq``).

Our ``nvfp4_gptq`` presets add ``true_sequential`` and ``asymmetric`` (ours, not ModelOpt's: docs/decisions/0029-calibrators.md,
"Ours, not ModelOpt's"); compare the gptq golden with ``{method: gptq, perc_damp: 0.01, block_size: 128, layerwise:
{enable: true}}`` and both off, which is ModelOpt's semantics. The comparison with our exports is then the max golden's test (``tests/models/qwen3_moe/test_qwen3_moe.py::
test_export_equals_modelopt_0_47``) with the algorithm's ``--qformat`` and the outlier stand-in; commit each JSON
with that test. Where an algorithm is not deterministic on the GPU (GPTQ's Hessian sums), compare scales and
codes within the difference the test states, not bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from modelopt_golden_qwen3_moe import record_tensors  # noqa: E402 - the max golden's recorder

ALGORITHMS = ("mse", "four_over_six", "local_hessian", "gptq")
_PRESETS = {"mse": "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG", "four_over_six": "NVFP4_FOUR_OVER_SIX_CFG",
            "local_hessian": "NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG"}
_GPTQ_RECIPE = "general/ptq/nvfp4_default-kv_none-gptq"


def _config(algorithm: str, work: Path):
    """ModelOpt's own quantize config of ``algorithm`` (and how it was named, for the record)."""
    import modelopt.torch.quantization as mtq

    if algorithm in _PRESETS:
        return getattr(mtq, _PRESETS[algorithm]), _PRESETS[algorithm]
    from modelopt.recipe.loader import load_recipe

    recipe = load_recipe(_GPTQ_RECIPE, overrides=[f"quantize.algorithm.layerwise.checkpoint_dir={work / 'layerwise'}"])
    return recipe.quantize.model_dump(exclude_unset=True), _GPTQ_RECIPE


def golden(algorithm: str, out: Path) -> Path:
    import modelopt
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    from modelopt_k3.testing.qwen3_moe import calibration_token_ids, make_tiny_qwen3_moe

    if not torch.cuda.is_available():
        raise SystemExit("ModelOpt's static-NVFP4 algorithms need CUDA and Triton; run this on a GPU machine")
    work = out / algorithm
    ckpt = make_tiny_qwen3_moe(work / "ckpt", seed=0, outliers=True, overwrite=True)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, experts_implementation="eager").cuda()
    model.eval()
    ids = calibration_token_ids().cuda()

    def forward_loop(m):
        with torch.no_grad():
            m(input_ids=ids)

    config, named = _config(algorithm, work)
    mtq.quantize(model, config, forward_loop)
    export = work / "export"
    export_hf_checkpoint(model, export_dir=str(export))
    record = {
        "_about": (
            f"nvidia-modelopt {modelopt.__version__}, transformers {transformers.__version__}, torch "
            f"{torch.__version__}, {torch.cuda.get_device_name()}: mtq.quantize({named}) with one forward of "
            "calibration_token_ids() + export_hf_checkpoint of make_tiny_qwen3_moe(seed=0, outliers=True) "
            "(bf16, experts_implementation=eager). Written by scripts/modelopt_golden_calibrators.py."
        ),
        "hf_quant_config": json.loads((export / "hf_quant_config.json").read_text()),
        "config_quantization_config": json.loads((export / "config.json").read_text()).get("quantization_config"),
        "tensors": dict(sorted(record_tensors(export).items())),
    }
    dest = Path(__file__).resolve().parents[1] / "tests" / "data" / f"modelopt_0_47_qwen3_moe_outliers_{algorithm}_golden.json"
    dest.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return dest


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    out, asked = Path(argv[0]), argv[1:] or list(ALGORITHMS)
    unknown = sorted(set(asked) - set(ALGORITHMS))
    if unknown:
        raise SystemExit(f"unknown algorithm(s) {unknown}; known: {list(ALGORITHMS)}")
    for algorithm in asked:
        print(f"wrote {golden(algorithm, out)}")


if __name__ == "__main__":
    main(sys.argv[1:])
