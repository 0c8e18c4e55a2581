"""Write tests/data/modelopt_0_47_deepseek_v3_golden.json: nvidia-modelopt 0.47.0's NVFP4 export of the tiny
block-FP8 DeepSeek-V3 stand-in under NVIDIA's DeepSeek-R1-NVFP4 recipe.

NOT run by the tests and not part of the package: it needs a scratch venv with nvidia-modelopt==0.47.0 (the
project never depends on it). Run from the repository root:

    PYTHONPATH=$PWD /path/to/venv-mo/bin/python scripts/modelopt_golden_deepseek_v3.py OUT_DIR

Steps (what tests/data/README.md states):

1. ``make_tiny_deepseek_v3(OUT_DIR/ckpt, source="block_fp8")`` (the default stand-in).
2. Every FP8 weight dequantized by transformers' own declared-block ``_dequantize_fp8_weight`` (fp32, one cast
   to BF16) into OUT_DIR/bf16; transformers' ``Fp8Dequantize`` load path is not used because it infers the
   block from the scale grid and gets the stand-in's partial blocks wrong (docs/decisions/0027-deepseek-v3.md).
3. ``AutoModelForCausalLM.from_pretrained(bf16, dtype=bfloat16, experts_implementation="eager")``.
4. The recipe of ModelOpt's ``examples/deepseek/ptq.py`` (its defaults) in the HF module names:
   ``NVFP4_DEFAULT_CFG``, the MLA projections off (``*attn*`` there, ``*self_attn*`` here), ``o_proj`` back on
   NVFP4 (``*wo*`` there), ``*head*`` off, every routed expert calibrated on every token (ptq.py's ``CalibMoe``:
   one extra, discarded MoE forward with top-k = all experts and all groups, then the real one).
   ModelOpt 0.47's own ``moe_calib_experts_ratio`` cannot do the last part here: it acts only through
   ``_QuantSparseSequentialMoe``, which claims an MoE block only when its ``experts`` is iterable, and
   transformers 5's fused ``DeepseekV3Experts`` is not; the script checks that the block stayed unwrapped, so
   its own extra forward is the only all-experts mechanism.
5. ``mtq.quantize`` with one forward of ``calibration_token_ids()``, ``export_hf_checkpoint`` into
   OUT_DIR/export, every exported tensor recorded (sha256, dtype, shape; one-element floats also as
   ``float.hex``) plus hf_quant_config.json and config.json's quantization_config.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _read(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[key] = f.get_tensor(key)
    return out


def dequantized_copy(ckpt: Path, dst: Path) -> Path:
    """ckpt with every E4M3 weight decoded by transformers' declared-block dequantize, scales dropped and
    quantization_config removed (a BF16 DeepSeek-V3 transformers loads as is)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    config = json.loads((ckpt / "config.json").read_text())
    block = config.pop("quantization_config")["weight_block_size"]
    stored = _read(ckpt)
    out = {}
    for key, t in stored.items():
        if key.endswith(".weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            t = _dequantize_fp8_weight(t, stored[key + "_scale_inv"], block, torch.float32).bfloat16()
        out[key] = t
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def deepseek_r1_nvfp4_cfg(mtq: Any) -> dict[str, Any]:
    """ptq.py's default DeepSeek recipe on top of NVFP4_DEFAULT_CFG (0.47's list form: later entries win)."""
    cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    entries = cfg["quant_cfg"]
    nvfp4 = {e["quantizer_name"]: e["cfg"] for e in entries if e.get("cfg") is not None}
    entries += [
        {"quantizer_name": "*head*", "enable": False},
        {"quantizer_name": "*self_attn*", "enable": False},
        {"quantizer_name": "*self_attn.o_proj.weight_quantizer", "cfg": copy.deepcopy(nvfp4["*weight_quantizer"]),
         "enable": True},
        {"quantizer_name": "*self_attn.o_proj.input_quantizer", "cfg": copy.deepcopy(nvfp4["*input_quantizer"]),
         "enable": True},
    ]
    return cfg


class AllExpertsCalibration:
    """ptq.py's CalibMoe on transformers' DeepseekV3MoE: while ``active``, each MoE forward first routes every
    token to every expert (top_k = n_routed_experts over all groups) and discards the result, then runs the
    model's own routing, whose output continues."""

    def __init__(self, model: torch.nn.Module) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        self.active = False
        self.blocks = [m for m in model.modules() if isinstance(m, DeepseekV3MoE)]
        for block in self.blocks:
            block.forward = self._wrap(block, block.forward)

    def _wrap(self, block: torch.nn.Module, forward: Any) -> Any:
        gate = block.gate

        def calib_forward(hidden_states: torch.Tensor) -> torch.Tensor:
            if self.active:
                top_k, groups = gate.top_k, gate.topk_group
                gate.top_k, gate.topk_group = gate.num_experts, gate.num_group
                try:
                    forward(hidden_states)
                finally:
                    gate.top_k, gate.topk_group = top_k, groups
            return forward(hidden_states)

        return calib_forward


def main(out: Path) -> None:
    import modelopt
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.nn import QuantModuleRegistry
    from transformers import AutoModelForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from modelopt_k3.testing.deepseek_v3 import calibration_token_ids, make_tiny_deepseek_v3

    ckpt = make_tiny_deepseek_v3(out / "ckpt", source="block_fp8", overwrite=True)
    bf16 = dequantized_copy(ckpt, out / "bf16")
    model = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16, experts_implementation="eager")
    model.eval()
    calib = AllExpertsCalibration(model)
    assert len(calib.blocks) == model.config.num_hidden_layers - model.config.first_k_dense_replace
    ids = calibration_token_ids()

    def forward_loop(m: torch.nn.Module) -> None:
        calib.active = True
        try:
            with torch.no_grad():
                m(input_ids=ids)
        finally:
            calib.active = False

    mtq.quantize(model, deepseek_r1_nvfp4_cfg(mtq), forward_loop)
    # ModelOpt's own all-experts path (moe_calib_experts_ratio) must not have claimed the block (see above).
    assert QuantModuleRegistry.get(DeepseekV3MoE) is None
    assert all(not hasattr(b, "_moe_calib_experts_ratio") for b in calib.blocks)
    export = out / "export"
    export_hf_checkpoint(model, export_dir=str(export))

    tensors: dict[str, dict] = {}
    for key, t in _read(export).items():
        row = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": _sha(t)}
        if t.numel() == 1 and t.is_floating_point():
            row["value"] = t.float().item().hex()
        tensors[key] = row
    golden = {
        "_about": (
            f"nvidia-modelopt {modelopt.__version__} (PyPI), transformers {transformers.__version__}, torch "
            f"{torch.__version__}, CPU: make_tiny_deepseek_v3(source='block_fp8') dequantized by transformers' "
            "_dequantize_fp8_weight (declared 128x128 block) and loaded by AutoModelForCausalLM (bf16, "
            "experts_implementation=eager); mtq.quantize(NVFP4_DEFAULT_CFG + ptq.py's DeepSeek entries: *head* "
            "off, *self_attn* off, *self_attn.o_proj* NVFP4) with one forward of "
            "modelopt_k3.testing.deepseek_v3.calibration_token_ids(), every DeepseekV3MoE first routing every "
            "token to every expert (ptq.py's CalibMoe, output discarded) + export_hf_checkpoint. Written by "
            "scripts/modelopt_golden_deepseek_v3.py."
        ),
        "hf_quant_config": json.loads((export / "hf_quant_config.json").read_text()),
        "config_quantization_config": json.loads((export / "config.json").read_text()).get("quantization_config"),
        "tensors": dict(sorted(tensors.items())),
    }
    dest = Path(__file__).resolve().parents[1] / "tests" / "data" / "modelopt_0_47_deepseek_v3_golden.json"
    dest.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"wrote {dest}: {len(tensors)} tensors")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
