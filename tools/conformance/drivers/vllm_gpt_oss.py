"""vLLM's own GPT-OSS loading of one export, on CPU; runs inside a vLLM venv (``run.py`` starts it for an export
whose config.json says ``model_type: gpt_oss``).

The same steps as ``vllm_k3.py`` (vLLM's ``ModelConfig`` / ``VllmConfig`` parse the export's configs and pick the
quantization method; its ``DefaultModelLoader`` builds ``GptOssForCausalLM``, runs its ``load_weights`` -- the
class's ``hf_to_vllm_mapper`` and ``GptOssModel.load_weights`` -- and ``process_weights_after_loading``; the same
stubs, ``stub_list.STUBS["vllm"]``). What differs is the map from vLLM's module names to the export's, for the
post-load scales: vLLM's GPT-OSS calls the attention ``attn`` (the mapper renames ``.self_attn.``), fuses
``q/k/v_proj`` into ``attn.qkv_proj``, and holds each layer's routed experts in one ``FusedMoE`` under
``mlp.experts.routed_experts`` whose ``w13`` is the checkpoint's ``gate_up_proj`` (gate and up interleaved in one
projection: both halves are the one export module) and ``w2`` its ``down_proj``.
"""

from __future__ import annotations

import sys

import _common as C
import vllm_k3
import vllm_qwen3

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
EXPERT_PROJS = {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}


def pieces_of(ours):
    by_name = C.pieces_by_name(ours, FUSED, EXPERT_PROJS)

    def pieces(engine_module: str):
        name = engine_module.removesuffix(".routed_experts").replace(".attn.", ".self_attn.")
        if name.endswith(".attn"):
            name = name.removesuffix(".attn") + ".self_attn"
        return by_name(name)

    return pieces


if __name__ == "__main__":
    # Engine-owned parameters as for Qwen3-MoE: the Attention layers' q/k/v/prob scales (kv_cache.py) when the
    # export declares no KV-cache quantization; the scale rules are Qwen3-MoE's (SwiGLU experts: no g1_scale_c).
    # max_model_len: the tiny GPT-OSS has max_position_embeddings 512, and vLLM's ModelConfig refuses a longer one.
    sys.exit(vllm_k3.main(pieces_of=pieces_of, owned_of=vllm_qwen3.owned_of, rules=vllm_qwen3.RULES,
                          defaults={"model_config": {"max_model_len": 512}}))
