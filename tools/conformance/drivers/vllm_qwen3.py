"""vLLM's own Qwen3-MoE loading of one export, on CPU; runs inside a vLLM venv (``run.py`` starts it for an
export whose config.json says ``model_type: qwen3_moe``).

The same steps as ``vllm_k3.py`` (vLLM's ``ModelConfig`` / ``VllmConfig`` parse the export's configs and pick
the ModelOpt method per layer; its ``DefaultModelLoader`` builds ``Qwen3MoeForCausalLM``, runs its
``load_weights`` and ``process_weights_after_loading``; the same stubs, ``stub_list.STUBS["vllm"]``); only the
module names behind the post-load scales differ: vLLM's Qwen3-MoE keeps the checkpoint's names and fuses
``q/k/v_proj`` into ``qkv_proj`` and a dense layer's ``gate/up_proj`` into ``gate_up_proj``
(``models/qwen3_moe.py``); its routed experts (one ``FusedMoE`` per layer, ``mlp.experts``) load each expert's
``gate_proj``/``up_proj`` as ``w13`` and ``down_proj`` as ``w2``.
"""

from __future__ import annotations

import json
import sys

import _common as C
import vllm_k3

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
EXPERT_PROJS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# vllm_k3.VLLM_RULES but g1_scale_c: for K3's SiTU it is the w2 input scale's inverse, for Qwen3-MoE's gated
# SiLU it is g1_alphas * a2_gscale (fused_moe/experts/trtllm_nvfp4_moe.py _compute_g1_scale_c), a product of
# two scales compared here already (w13_weight_scale_2 after its in-place multiply, w2_input_scale).
RULES = {k: v for k, v in vllm_k3.VLLM_RULES.items() if k != "g1_scale_c"}


def pieces_of(ours):
    by_name = C.pieces_by_name(ours, FUSED, EXPERT_PROJS)
    # The FusedMoE sits under the experts module as ``routed_experts`` (vLLM's MoE runner, as in vllm_k3.py).
    return lambda engine_module: by_name(engine_module.removesuffix(".routed_experts"))


def _quantization(export) -> dict:
    hf = export / "hf_quant_config.json"
    return json.loads(hf.read_text()).get("quantization", {}) if hf.exists() else {}


def owned_of(model, export) -> dict[str, str]:
    """Parameters vLLM's Qwen3-MoE creates that no such export has, and what vLLM does with them:

    * the ``Attention`` layers' ``q/k/v/prob_scale`` (``quantization/kv_cache.py`` ``BaseKVCacheMethod``:
      created at -1.0, "not loaded", and set to 1.0 by its ``process_weights_after_loading``), when the export
      declares no KV-cache quantization;
    * a W4A16_NVFP4 linear's ``input_scale`` (``quantization/modelopt.py`` ``_DropInputScale``: registered as a
      NaN placeholder for older checkpoints, deleted after loading; a weight-only export has none).
    """
    quant = _quantization(export)
    owned = {}
    if not quant.get("kv_cache_quant_algo"):
        for n, _ in model.named_parameters():
            if n.endswith((".attn.q_scale", ".attn.k_scale", ".attn.v_scale", ".attn.prob_scale")):
                owned[n] = ("an Attention-layer scale kept at its 'not loaded' -1.0, set to 1.0 after loading "
                            "(kv_cache.py BaseKVCacheMethod; the export declares no KV-cache quantization)")
    if quant.get("quant_algo") == "W4A16_NVFP4":
        for n, _ in model.named_parameters():
            if n.endswith(".input_scale") and ".experts." not in n and not n.endswith(("w13_input_scale", "w2_input_scale")):
                owned[n] = ("a W4A16_NVFP4 linear's NaN input_scale placeholder, deleted after loading "
                            "(modelopt.py _DropInputScale); a weight-only export has no input_scale")
    return owned


if __name__ == "__main__":
    sys.exit(vllm_k3.main(pieces_of=pieces_of, owned_of=owned_of, rules=RULES))
