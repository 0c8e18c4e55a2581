"""SGLang's own Kimi-K2.5 loading of one export, on CPU; runs inside an SGLang venv (``run.py`` starts it for an
export whose config.json says ``model_type: kimi_k25``).

SGLang's ``KimiK25ForConditionalGeneration`` (``models/kimi_k25.py``) holds ``DeepseekV3ForCausalLM`` as
``language_model`` and loads the vision tower and projector itself, renaming ``wqkv``/``wo`` to
``attn.qkv_proj``/``attn.proj`` and ``mm_projector.proj.{0,2}`` to ``linear_{1,2}``; so this is
``sglang_deepseek_v3.py`` (steps, stubs, module map, KV-cache scales) with those vision names mapped back. Not run
in the session that wrote it (no SGLang venv on that machine): the kimi_k25 verdicts of ``modelopt-k3-check`` say
"not verified there" until it is.
"""

from __future__ import annotations

import sys

import sglang_deepseek_v3
import sglang_k3
import sglang_qwen3

VISION = (("mm_projector.linear_1", "mm_projector.proj.0"), ("mm_projector.linear_2", "mm_projector.proj.2"),
          (".attn.qkv_proj", ".wqkv"), (".attn.proj", ".wo"))


def pieces_of(ours):
    text = sglang_deepseek_v3.pieces_of(ours)

    def pieces(engine_module: str):
        for engine, ckpt in VISION:
            if engine_module.startswith(("vision_tower.", "mm_projector.")):
                engine_module = engine_module.replace(engine, ckpt)
        return text(engine_module)

    return pieces


if __name__ == "__main__":
    sys.exit(sglang_k3.main(sglang_qwen3.DEFAULTS, pieces_of, sglang_deepseek_v3.apply_stubs,
                            post_checks=sglang_deepseek_v3.post_checks))
