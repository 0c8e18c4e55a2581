"""SGLang's own Qwen3.5-MoE loading of one export, on CPU; runs inside an SGLang venv (``run.py`` starts it for an
export whose config.json says ``model_type: qwen3_5_moe``). Not yet run in an SGLang venv (none on the machine it
was written on); what it observes is what ``models/qwen3_5_moe/serving.py`` calls "not verified" for SGLang.

The same steps as ``sglang_qwen3.py``; the module map behind the post-load scales takes vLLM's names for the
VLM (``vllm_qwen3_5_moe.export_name``: SGLang's ``Qwen3_5MoeForConditionalGeneration`` derives from its
Qwen3-VL class) and its fusions (``qkv_proj``, the shared expert's ``gate_up_proj``, the gated delta net's
``in_proj_qkvz`` / ``in_proj_ba``, as ``qwen3_5.py`` ``Qwen3_5GatedDeltaNet`` builds them).
"""

from __future__ import annotations

import sys

import _common as C
import sglang_k3
import sglang_qwen3
import vllm_qwen3_5_moe as V


def pieces_of(ours):
    by_name = C.pieces_by_name(ours, V.FUSED, V.EXPERT_PROJS)
    return lambda engine_module: by_name(V.export_name(engine_module))


if __name__ == "__main__":
    sys.exit(sglang_k3.main(sglang_qwen3.DEFAULTS, pieces_of, sglang_qwen3.apply_stubs))
