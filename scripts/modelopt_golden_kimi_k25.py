"""Write tests/data/modelopt_0_47_kimi_k25_golden.json: nvidia-modelopt 0.47.0's NVFP4 export of the tiny
Kimi-K2.5 stand-in's text model under the Kimi-K2.5 recipe (routed experts NVFP4 W4A4, everything else BF16).

NOT run by the tests and not part of the package: it needs a scratch venv with nvidia-modelopt==0.47.0 (the
project never depends on it). Run from the repository root:

    PYTHONPATH=$PWD /path/to/venv-mo/bin/python scripts/modelopt_golden_kimi_k25.py OUT_DIR

Steps:

1. ``make_tiny("kimi_k25", OUT_DIR/ckpt)`` (the registry's stand-in: INT4 experts, MoonViT).
2. Its text model as a BF16 DeepSeek-V3 checkpoint in OUT_DIR/bf16: every INT4 expert decoded by
   compressed-tensors' own ``PackedQuantizationCompressor`` (BF16), ``language_model.model.`` -> ``model.``,
   ``language_model.lm_head`` -> ``lm_head``, config = ``text_config`` without its quantization_config. ModelOpt
   is not given transformers' ``Kimi_K25ForConditionalGeneration``: its HF export writes the text layers as
   ``language_model.model.blocks.N`` (transformers' vision-only rename reversed, issue 40), and the vision tower,
   which no recipe here quantizes, is carried by our export as stored anyway.
3. ``AutoModelForCausalLM.from_pretrained(bf16, dtype=bfloat16, experts_implementation="eager")``.
4. ``NVFP4_DEFAULT_CFG`` with every quantizer off but the routed experts' (``*mlp.experts*``), every routed
   expert calibrated on every token (the DeepSeek-V3 golden's ``AllExpertsCalibration``, ptq.py's CalibMoe).
5. ``mtq.quantize`` with one forward of ``calibration_token_ids()``, ``export_hf_checkpoint``; every exported
   tensor recorded (sha256, dtype, shape; one-element floats also as ``float.hex``) and hf_quant_config.json.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]


def _deepseek_golden() -> Any:
    """scripts/modelopt_golden_deepseek_v3.py (its reader, hash and all-experts calibration), loaded by path."""
    spec = importlib.util.spec_from_file_location("golden_dsv3", ROOT / "scripts" / "modelopt_golden_deepseek_v3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def text_bf16_copy(ckpt: Path, dst: Path, read) -> Path:
    """The stand-in's text model as a BF16 DeepSeek-V3 checkpoint (module docstring, step 2)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    config = json.loads((ckpt / "config.json").read_text())
    w = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**{
        k: w[k] for k in ("num_bits", "type", "strategy", "group_size", "symmetric")}))
    text = {k: v for k, v in config["text_config"].items() if k != "quantization_config"}
    tensors, out = read(ckpt), {}
    for key, t in tensors.items():
        if not key.startswith("language_model.") or key.endswith((".weight_scale", ".weight_shape")):
            continue
        name = key.replace("language_model.model.", "model.", 1).replace("language_model.lm_head", "lm_head", 1)
        if key.endswith(".weight_packed"):
            head = key.removesuffix(".weight_packed")
            state = {n: tensors[f"{head}.{n}"] for n in ("weight_packed", "weight_scale", "weight_shape")}
            t = PackedQuantizationCompressor.decompress(state, scheme)["weight"].bfloat16()
            name = name.removesuffix("_packed")
        out[name] = t
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps({**text, "model_type": "deepseek_v3",
                                                 "architectures": ["DeepseekV3ForCausalLM"]}))
    return dst


def experts_only_nvfp4_cfg(mtq: Any) -> dict[str, Any]:
    """NVFP4_DEFAULT_CFG with only the routed experts' quantizers on (0.47's list form: later entries win)."""
    cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    entries = cfg["quant_cfg"]
    nvfp4 = {e["quantizer_name"]: e["cfg"] for e in entries if e.get("cfg") is not None}
    entries += [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*mlp.experts*weight_quantizer", "cfg": copy.deepcopy(nvfp4["*weight_quantizer"]),
         "enable": True},
        {"quantizer_name": "*mlp.experts*input_quantizer", "cfg": copy.deepcopy(nvfp4["*input_quantizer"]),
         "enable": True},
    ]
    return cfg


def main(out: Path) -> None:
    import modelopt
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    from modelopt_k3.testing import make_tiny
    from modelopt_k3.testing.kimi_k25 import calibration_token_ids

    dsv3 = _deepseek_golden()
    ckpt = make_tiny("kimi_k25", out / "ckpt", overwrite=True)
    bf16 = text_bf16_copy(ckpt, out / "bf16", dsv3._read)
    model = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16, experts_implementation="eager")
    model.eval()
    calib = dsv3.AllExpertsCalibration(model)
    assert len(calib.blocks) == model.config.num_hidden_layers - model.config.first_k_dense_replace
    ids = calibration_token_ids()

    def forward_loop(m: torch.nn.Module) -> None:
        calib.active = True
        try:
            with torch.no_grad():
                m(input_ids=ids)
        finally:
            calib.active = False

    mtq.quantize(model, experts_only_nvfp4_cfg(mtq), forward_loop)
    export = out / "export"
    export_hf_checkpoint(model, export_dir=str(export))
    tensors: dict[str, dict] = {}
    for key, t in dsv3._read(export).items():
        row = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": dsv3._sha(t)}
        if t.numel() == 1 and t.is_floating_point():
            row["value"] = t.float().item().hex()
        tensors[key] = row
    golden = {
        "_about": (
            f"nvidia-modelopt {modelopt.__version__} (PyPI), transformers {transformers.__version__}, torch "
            f"{torch.__version__}, CPU: make_tiny('kimi_k25')'s text model, INT4 experts decoded by compressed-tensors "
            "(BF16), names without language_model.; AutoModelForCausalLM (bf16, experts_implementation=eager); "
            "mtq.quantize(NVFP4_DEFAULT_CFG, every quantizer off but *mlp.experts*) with one forward of "
            "modelopt_k3.testing.kimi_k25.calibration_token_ids(), every DeepseekV3MoE first routing every token to "
            "every expert (ptq.py's CalibMoe) + export_hf_checkpoint. Written by scripts/modelopt_golden_kimi_k25.py."
        ),
        "hf_quant_config": json.loads((export / "hf_quant_config.json").read_text()),
        "tensors": dict(sorted(tensors.items())),
    }
    dest = ROOT / "tests" / "data" / "modelopt_0_47_kimi_k25_golden.json"
    dest.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"wrote {dest}: {len(tensors)} tensors")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
