"""vLLM's own Kimi-K2.5 loading of one export, on CPU; runs inside a vLLM venv (``run.py`` starts it for an export
whose config.json says ``model_type: kimi_k25``).

vLLM's ``KimiK25ForConditionalGeneration`` builds its text model as ``DeepseekV2ForCausalLM`` under
``language_model`` (``models/kimi_k25.py``; the rules: ``modelopt_k3/models/kimi_k25/serving.py``),
so this is ``vllm_deepseek_v3.py`` (the same steps, module map, KV-cache and owned-parameter rules) with the
projector's vLLM names (``mm_projector.linear_{1,2}``, ``hf_to_vllm_mapper``) mapped back to the checkpoint's
``mm_projector.proj.{0,2}``. Not run in the session that wrote it (no vLLM venv on that machine): the kimi_k25
verdicts of ``modelopt-k3-check`` say "not verified there" until it is.
"""

from __future__ import annotations

import sys

import vllm_deepseek_v3
import vllm_k3
import vllm_qwen3

PROJECTOR = {"mm_projector.linear_1": "mm_projector.proj.0", "mm_projector.linear_2": "mm_projector.proj.2"}


def pieces_of(ours):
    text = vllm_deepseek_v3.pieces_of(ours)
    return lambda engine_module: text(PROJECTOR.get(engine_module, engine_module))


if __name__ == "__main__":
    sys.exit(vllm_k3.main(pieces_of=pieces_of, owned_of=vllm_deepseek_v3.owned_of, rules=vllm_qwen3.RULES,
                          serve_config=vllm_deepseek_v3.serve_config, post_checks=vllm_deepseek_v3.post_checks))
