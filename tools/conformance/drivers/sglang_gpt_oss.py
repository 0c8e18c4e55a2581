"""SGLang's own GPT-OSS loading of one export, on CPU; runs inside an SGLang venv (``run.py`` starts it for an
export whose config.json says ``model_type: gpt_oss``).

The same steps as ``sglang_qwen3.py`` (SGLang's ``ServerArgs`` / ``ModelConfig`` pick the quantization config;
its ``DefaultModelLoader`` builds ``GptOssForCausalLM``, runs its ``load_weights`` -- for a ModelOpt config
``_load_normal_weights`` -- and every layer's ``process_weights_after_loading``; then the first routed-experts
layer's forward up to its kernel call; ``--moe-runner-backend`` left at ``auto`` so SGLang's own model overrides
pick the runner, recorded; the stubs of ``sglang_qwen3.apply_stubs``). The module map behind the post-load scales:
SGLang's GPT-OSS keeps ``self_attn``, fuses ``q/k/v_proj`` into ``qkv_proj`` and loads each layer's experts into one
``FusedMoE`` (``mlp.experts``) whose ``w13`` is the checkpoint's ``gate_up_proj`` (gate and up interleaved in one
projection) and ``w2`` its ``down_proj``.
"""

from __future__ import annotations

import sys

import _common as C
import sglang_k3
import sglang_qwen3

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
EXPERT_PROJS = {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}


def pieces_of(ours):
    return C.pieces_by_name(ours, FUSED, EXPERT_PROJS)


if __name__ == "__main__":
    sys.exit(sglang_k3.main(sglang_qwen3.DEFAULTS, pieces_of, sglang_qwen3.apply_stubs))
