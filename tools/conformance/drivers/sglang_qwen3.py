"""SGLang's own Qwen3-MoE loading of one export, on CPU; runs inside an SGLang venv (``run.py`` starts it for
an export whose config.json says ``model_type: qwen3_moe``).

The same steps as ``sglang_k3.py`` (SGLang's ``ServerArgs`` / ``ModelConfig`` pick the quantization config;
its ``DefaultModelLoader`` builds ``Qwen3MoeForCausalLM``, runs ``load_weights`` and every layer's
``process_weights_after_loading``; then the first routed-experts layer's forward up to its kernel call; the
same stubs, ``stub_list.STUBS["sglang"]``), with two differences:

* ``--moe-runner-backend`` is left at SGLang's default ``auto``, so the engine's own Qwen3-MoE override
  (``_qwen3_moe_family_overrides``) decides the runner; the driver records what it resolved to.
* the module names behind the post-load scales: SGLang's Qwen3-MoE keeps the checkpoint's names, fuses
  ``q/k/v_proj`` into ``qkv_proj`` (and a dense MLP's ``gate/up_proj`` into ``gate_up_proj``, where one is
  built) and loads each expert's ``gate_proj``/``up_proj`` as ``w13``, ``down_proj`` as ``w2``.
"""

from __future__ import annotations

import sys

import _common as C
import sglang_k3

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
EXPERT_PROJS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
DEFAULTS = {"moe_runner_backend": "auto", "other_backends": ()}


def pieces_of(ours):
    return C.pieces_by_name(ours, FUSED, EXPERT_PROJS)


def apply_stubs():
    """``sglang_k3.apply_stubs``, and the rotary embedding's module-level ``_is_cuda`` true (it reads
    ``torch.cuda.is_available()`` at import, before any platform override): on a CUDA machine
    ``RotaryEmbedding.__init__`` takes its rope kernel from ``sglang.kernels``; on the CPU it would import
    vLLM's instead, which an SGLang venv does not have. Only the rope kernel and the cos/sin cache's
    dtype (FP32 on CUDA, a buffer no checkpoint holds) depend on it; no weight does."""
    stubbed = sglang_k3.apply_stubs()
    import sglang.srt.layers.rotary_embedding.base as rope

    rope._is_cuda = True
    return stubbed


if __name__ == "__main__":
    sys.exit(sglang_k3.main(DEFAULTS, pieces_of, apply_stubs))
