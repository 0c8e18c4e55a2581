"""llm-compressor's side of ``bench_peer_calibrators`` (issue 43 item 4), run by the PEER's interpreter.

    PEER_PYTHON benchmarks/peer_llmcompressor.py --ckpt CKPT --tokens TOKENS.safetensors --method M --out OUT

Never imported by this project and never a dependency: it needs a scratch venv with ``llmcompressor==0.14.0.1``
(``transformers<=5.17``, ``compressed-tensors==0.19.0``, ``torch==2.13.0``; see ``benchmarks/README.md``).

It runs llm-compressor's ``oneshot`` as its README does for an NVFP4 MoE: the checkpoint loaded in BF16 with
linearized experts (``linearize_moe``), every Linear but ``lm_head`` and the routers NVFP4 (scheme
``NVFP4``: W4A4, group 16, static per-tensor global scales), with

* ``max``: ``QuantizationModifier`` (min-max observers: RTN);
* ``gptq``: ``GPTQModifier``;
* ``awq``: ``AWQModifier`` with its own default mappings for the architecture (``_moe_default_mappings``:
  input norm -> q/k/v, v -> o, post-attention norm -> router + experts' gate/up, up -> down), the
  post-attention one split by layer kind (``awq_mappings``), then ``QuantizationModifier``;
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


def _moe_layers(config: dict) -> list[int]:
    """The decoder layers with a sparse MoE block (Qwen3-MoE's rule: ``mlp_only_layers`` and ``decoder_sparse_step``)."""
    step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers", []))
    return [i for i in range(config["num_hidden_layers"])
            if i not in dense and config.get("num_experts", 0) > 0 and (i + 1) % step == 0]


def awq_mappings(config: dict) -> list:
    """llm-compressor's default Qwen3-MoE mappings, with the post-attention norm's split into MoE and dense layers.

    Its default (``re:.*post_attention_layernorm$`` -> router and experts' gate/up) cannot resolve on a model with
    a dense layer between MoE layers (the stand-in's layer 1, as DeepSeek-V3's first layers are dense): the dense
    layer's norm has no router after it, so ``match_modules_set`` pairs two norms with one set of balance layers
    and ``AWQModifier`` raises "AWQ needs to match a single smoothlayer". Anchoring that one mapping to the layers
    of each kind (the dense layers take the dense default: norm -> gate_proj/up_proj) keeps every other mapping
    and every smoothing the default would do."""
    from llmcompressor.modifiers.transform.awq import AWQMapping

    def layers(ids: list[int]) -> str:
        return rf"layers\.({'|'.join(map(str, ids))})\."

    moe = _moe_layers(config)
    dense = [i for i in range(config["num_hidden_layers"]) if i not in moe]
    out = [AWQMapping("re:.*input_layernorm$", ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]),
           AWQMapping("re:.*v_proj$", ["re:.*o_proj$"])]
    if moe:
        out.append(AWQMapping(f"re:.*{layers(moe)}post_attention_layernorm$",
                              [f"re:.*{layers(moe)}mlp\\.gate$", f"re:.*{layers(moe)}mlp\\.experts\\..*\\.gate_proj$",
                               f"re:.*{layers(moe)}mlp\\.experts\\..*\\.up_proj$"]))
    if dense:
        out.append(AWQMapping(f"re:.*{layers(dense)}post_attention_layernorm$",
                              [f"re:.*{layers(dense)}mlp\\.gate_proj$", f"re:.*{layers(dense)}mlp\\.up_proj$"]))
    out.append(AWQMapping("re:.*up_proj$", ["re:.*down_proj$"]))
    return out


def modifiers(method: str, config: dict) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    scheme = {"targets": "Linear", "scheme": "NVFP4", "ignore": IGNORE}
    return {
        "max": lambda: [QuantizationModifier(**scheme)],
        "gptq": lambda: [GPTQModifier(**scheme)],
        "awq": lambda: [AWQModifier(mappings=awq_mappings(config)), QuantizationModifier(**scheme)],
        "awq_gptq": lambda: [AWQModifier(mappings=awq_mappings(config)), GPTQModifier(**scheme)],
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


def _no_pinning_without_accelerator() -> None:
    """llm-compressor 0.14.0.1's AWQ pins its cached activations (``IntermediatesCache.pin_memory``, for
    non-blocking host-to-device copies) whether or not an accelerator exists, and ``Tensor.pin_memory`` raises
    "Cannot access accelerator device when none is available" on a CPU-only machine: AWQ stops there. Pinning
    only speeds up transfers (the values are the same), so on CPU it is skipped."""
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None


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

    if not torch.cuda.is_available():
        _no_pinning_without_accelerator()
    torch.manual_seed(0)
    calib = load_file(args.tokens)["calib"]
    # Loaded fused, then linearized (``linearize_moe``: the post-load path of ``load_quantizable_moe``, whose
    # load-time patching imports every transformers model and needs torchvision, which this venv lacks).
    model = transformers.AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.bfloat16)
    linearize_moe(model)
    data = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
    start = time.perf_counter()
    oneshot(model=model, dataset=data, recipe=modifiers(args.method, json.loads((Path(args.ckpt) / "config.json").read_text())), num_calibration_samples=len(calib),
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
