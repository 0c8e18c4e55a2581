"""SGLang's own DeepSeek-V3 loading of one export, on CPU; runs inside an SGLang venv (``run.py`` starts it for
an export whose config.json says ``model_type: deepseek_v3``).

The same steps as ``sglang_qwen3.py`` (SGLang's ``ServerArgs`` / ``ModelConfig`` pick the quantization config; its
``DefaultModelLoader`` builds ``DeepseekV3ForCausalLM`` -- ``models/deepseek_v2.py`` with the loader of
``models/deepseek_common/deepseek_weight_loader.py`` -- runs ``load_weights`` (whose ``post_load_weights`` builds the
MLA's ``w_kc``/``w_vc`` from ``kv_b_proj``) and every layer's ``process_weights_after_loading``; then the first
routed-experts layer's forward up to its kernel call; ``--moe-runner-backend`` left at ``auto``, recorded; the
stubs of ``sglang_qwen3.apply_stubs`` and the rope device, ``apply_stubs``). What is this model's own:

* the module map behind the post-load scales: SGLang keeps the checkpoint's names, loads ``q_a_proj`` +
  ``kv_a_proj_with_mqa`` into one ``fused_qkv_a_proj_with_mqa`` and a dense MLP's (or the shared experts')
  ``gate/up_proj`` into ``gate_up_proj``; routed experts ``gate_proj``/``up_proj`` as ``w13``, ``down_proj`` as
  ``w2``;
* with FP8 KV-cache scales in the export, the scales each attention layer computes with after loading
  (``k_scale_float`` / ``v_scale_float``, set by ``kv_cache.py BaseKVCacheMethod.process_weights_after_loading``)
  are compared with the export's per-layer ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale``, on every
  ``RadixAttention`` of the layer (``attn_mqa`` and ``attn_mha`` alike).
"""

from __future__ import annotations

import sys

import _common as C
import sglang_k3
import sglang_qwen3
import torch
import vllm_deepseek_v3

FUSED = {"fused_qkv_a_proj_with_mqa": ("q_a_proj", "kv_a_proj_with_mqa"), "gate_up_proj": ("gate_proj", "up_proj")}
EXPERT_PROJS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
KV_ATTRS = {"k_scale_float": "k", "v_scale_float": "v"}


def pieces_of(ours):
    return C.pieces_by_name(ours, FUSED, EXPERT_PROJS)


def apply_stubs():
    """``sglang_qwen3.apply_stubs``, and ``models/deepseek_v2.py``'s rope factory asked for the device a CUDA run
    passes: ``DeepseekV2AttentionMLA.__init__`` calls ``get_rope_wrapper(..., device=get_device().device)``, which on
    the runtime device ``cpu`` goes to SGLang's CPU-backend factory (``rotary_embedding/factory.py get_rope_cpu``:
    it asserts a ``rope_scaling``, the tiny config has none) and on ``cuda`` to ``get_rope``, the one a GPU serve
    builds. A rope holds no checkpoint tensor (its cos/sin cache is a non-persistent buffer)."""
    stubbed = sglang_qwen3.apply_stubs()
    import sglang.srt.models.deepseek_v2 as deepseek_v2

    factory = deepseek_v2.get_rope_wrapper

    def rope_as_on_cuda(*args, **kwargs):
        if kwargs.get("device") == "cpu":
            kwargs["device"] = "cuda"
        return factory(*args, **kwargs)

    deepseek_v2.get_rope_wrapper = rope_as_on_cuda
    import sglang.srt.layers.attention.dsa.dsa_indexer as dsa_indexer  # GLM-5's indexer builds its rope the same way

    dsa_indexer.get_rope_wrapper = rope_as_on_cuda
    # The platform facts' compute capability also where a server-argument hook asks torch for it directly (GLM-5 /
    # DeepSeek-V3.2's sparse-attention defaults, arg_groups/model_hook.py handle_model_specific_adjustments).
    torch.cuda.get_device_capability = lambda *args, **kwargs: sglang_k3.PLATFORM["device_capability"]
    return stubbed


def post_checks(model, ours) -> dict:
    if not any(k.endswith(".k_proj.k_scale") for k in ours):
        return {}
    return C.compare_kv_scales(model, ours, KV_ATTRS)


if __name__ == "__main__":
    sys.exit(sglang_k3.main(sglang_qwen3.DEFAULTS, pieces_of, apply_stubs, post_checks=post_checks,
                            by_design=vllm_deepseek_v3.by_design))
