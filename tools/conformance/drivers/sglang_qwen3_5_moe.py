"""SGLang's own Qwen3.5-MoE loading of one export, on CPU; runs inside an SGLang venv (``run.py`` starts it for an
export whose config.json says ``model_type: qwen3_5_moe``).

The same steps as ``sglang_qwen3.py``. The module map behind the post-load scales: SGLang's
``Qwen3_5MoeForConditionalGeneration.load_weights`` renames ``model.language_model.`` to ``model.``, drops
``.self_attn`` and loads ``model.visual.`` as ``visual.`` (``lm_head`` as is); its fusions are vLLM's (``qkv_proj``,
the shared expert's ``gate_up_proj``, the gated delta net's ``in_proj_qkvz`` / ``in_proj_ba``). ``mtp.*`` is skipped
by the main model (``vllm_qwen3_5_moe.by_design``).
"""

from __future__ import annotations

import sys

import _common as C
import sglang_k3
import sglang_qwen3
import vllm_qwen3_5_moe as V


def export_name(engine_module: str) -> str:
    """SGLang's module name -> the export's (the inverse of its ``load_weights`` renames, module docstring)."""
    if engine_module.startswith("model.layers."):
        return "model.language_model." + engine_module.removeprefix("model.")
    if engine_module.startswith("visual."):
        return "model." + engine_module
    return engine_module


def pieces_of(ours):
    by_name = C.pieces_by_name(ours, V.FUSED, V.EXPERT_PROJS)
    return lambda engine_module: by_name(export_name(engine_module))


if __name__ == "__main__":
    sys.exit(sglang_k3.main(sglang_qwen3.DEFAULTS, pieces_of, sglang_qwen3.apply_stubs, by_design=V.by_design))
