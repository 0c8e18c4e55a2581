"""SGLang's own Nemotron-H loading of one export, on CPU; runs inside an SGLang venv (``run.py`` starts it for an
export whose config.json says ``model_type: nemotron_h``).

The same steps as ``sglang_qwen3.py`` (SGLang's ``ServerArgs`` / ``ModelConfig`` pick the quantization config; its
``DefaultModelLoader`` builds ``NemotronHForCausalLM``, runs its ``load_weights`` and every layer's
``process_weights_after_loading``; the stubs of ``sglang_qwen3.apply_stubs``). The module map behind the post-load
scales: ``load_weights`` renames ``backbone`` to ``model`` and skips ``mtp``, fuses ``q/k/v_proj`` into ``qkv_proj``
and loads each MoE layer's non-gated experts into one ``FusedMoE`` (``mixer.experts``: ``w1`` the checkpoint's
``up_proj``, ``w2`` its ``down_proj``); ``A_log`` and ``mtp.*`` as ``vllm_nemotron_h.by_design`` says.
"""

from __future__ import annotations

import sys

import _common as C
import sglang_k3
import sglang_qwen3
import vllm_nemotron_h

EXPERT_PROJS = {"w1": "up_proj", "w2": "down_proj"}


def pieces_of(ours):
    by_name = C.pieces_by_name(ours, vllm_nemotron_h.FUSED, EXPERT_PROJS)
    return lambda engine_module: by_name(vllm_nemotron_h.export_name(engine_module))


if __name__ == "__main__":
    sys.exit(sglang_k3.main(sglang_qwen3.DEFAULTS, pieces_of, sglang_qwen3.apply_stubs,
                            by_design=vllm_nemotron_h.by_design))
