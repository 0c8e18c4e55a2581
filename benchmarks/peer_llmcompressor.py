"""llm-compressor's side of ``bench_peer_calibrators`` (issue 43 item 4), run by the PEER's interpreter.

    PEER_PYTHON benchmarks/peer_llmcompressor.py --ckpt CKPT --tokens TOKENS.safetensors --method M --out OUT

Never imported by this project and never a dependency: it needs a scratch venv with ``llmcompressor==0.14.0.1``
(``transformers<=5.17``, ``compressed-tensors==0.19.0``, ``torch==2.13.0``; see ``benchmarks/README.md``).

It runs llm-compressor's ``oneshot`` as its README does for an NVFP4 MoE: the checkpoint loaded in BF16 with
linearized experts (``linearize_moe``), every Linear but ``lm_head`` and the routers NVFP4 (scheme
``NVFP4``: W4A4, group 16, static per-tensor global scales), with

* ``max``: ``QuantizationModifier`` (min-max observers: RTN);
* ``gptq``: ``GPTQModifier``;
* ``awq``: ``AWQModifier`` (its default mappings for the architecture) then ``QuantizationModifier``;
* ``awq_gptq``: ``AWQModifier`` then ``GPTQModifier`` (llm-compressor #3001's best pair),

on the calibration tokens given (``calib``: ``[N, S]`` int64; no shuffling, no padding), every other option at its
default but ``moe_calibrate_all_experts``, set to ``--all_experts`` (this project's default is false: both sides
calibrate an expert on the tokens routed to it). The ``oneshot`` call is timed (the load is not).

Written to ``OUT`` (safetensors): every parameter of the calibrated model, each quantized Linear's ``weight`` as
compressed-tensors' own ``fake_quantize`` returns it (the numbers its NVFP4 checkpoint decodes to), plus
``<linear>.input_amax`` (fp32): the activation amax its ``input_global_scale`` encodes (``6 * 448 / scale``).
``OUT.json``: the time and versions. The bench's own process evaluates both sides with one evaluator.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP4_MAX, FP8_MAX = 6.0, 448.0
IGNORE = ["lm_head", "re:.*mlp\\.gate$"]  # routers (Qwen3-MoE's ``mlp.gate``) and lm_head stay BF16, as ours


def modifiers(method: str) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    scheme = {"targets": "Linear", "scheme": "NVFP4", "ignore": IGNORE}
    return {
        "max": lambda: [QuantizationModifier(**scheme)],
        "gptq": lambda: [GPTQModifier(**scheme)],
        "awq": lambda: [AWQModifier(), QuantizationModifier(**scheme)],
        "awq_gptq": lambda: [AWQModifier(), GPTQModifier(**scheme)],
    }[method]()


def dequantized(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter; each quantized Linear's weight fake-quantized as its checkpoint decodes, and its input amax."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    out = {name: p.detach().clone().contiguous() for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        w = module.weight.detach()
        out[f"{name}.weight"] = fake_quantize(w, module.weight_scale, module.weight_zero_point, scheme.weights,
                                              global_scale=getattr(module, "weight_global_scale", None)).to(w.dtype)
        g = getattr(module, "input_global_scale", None)
        if scheme.input_activations is not None and g is not None:
            out[f"{name}.input_amax"] = (FP4_MAX * FP8_MAX / g.detach().float()).reshape(())
    return {k: v.contiguous() for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--method", required=True, choices=("max", "gptq", "awq", "awq_gptq"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--all_experts", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import compressed_tensors
    import llmcompressor
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe

    torch.manual_seed(0)
    calib = load_file(args.tokens)["calib"]
    # Loaded fused, then linearized (``linearize_moe``: the post-load path of ``load_quantizable_moe``, whose
    # load-time patching imports every transformers model and needs torchvision, which this venv lacks).
    model = transformers.AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.bfloat16)
    linearize_moe(model)
    data = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
    start = time.perf_counter()
    oneshot(model=model, dataset=data, recipe=modifiers(args.method), num_calibration_samples=len(calib),
            max_seq_length=calib.shape[1], shuffle_calibration_samples=False,
            moe_calibrate_all_experts=args.all_experts)
    seconds = time.perf_counter() - start
    save_file(dequantized(model), args.out)
    Path(args.out + ".json").write_text(json.dumps({
        "method": args.method, "seconds": seconds, "llmcompressor": llmcompressor.__version__,
        "compressed_tensors": compressed_tensors.__version__, "transformers": transformers.__version__,
        "torch": torch.__version__, "all_experts": args.all_experts}, indent=1))


if __name__ == "__main__":
    main()
