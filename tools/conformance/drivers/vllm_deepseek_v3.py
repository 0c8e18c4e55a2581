"""vLLM's own DeepSeek-V3 loading of one export, on CPU; runs inside a vLLM venv (``run.py`` starts it for an
export whose config.json says ``model_type: deepseek_v3``).

The same steps as ``vllm_k3.py`` (vLLM's ``ModelConfig`` / ``VllmConfig`` parse the export's configs and pick the
ModelOpt method per layer; its ``DefaultModelLoader`` builds ``DeepseekV3ForCausalLM`` -- ``models/deepseek_v2.py``
-- runs its ``load_weights`` and ``process_weights_after_loading``, where the MLA layer splits ``kv_b_proj``; the
same stubs, ``stub_list.STUBS["vllm"]``). What is this model's own:

* the module map behind the post-load scales: vLLM keeps the checkpoint's names and fuses ``q_a_proj`` +
  ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj`` and a dense MLP's (or the shared experts') ``gate/up_proj``
  into ``gate_up_proj``; the routed experts are one ``FusedMoE`` per layer under ``mlp.experts.routed_experts``
  (``gate_proj``/``up_proj`` as ``w13``, ``down_proj`` as ``w2``);
* the KV-cache dtype is the one ``vllm serve`` resolves ``auto`` to for the export (``serve_config``: FP8 for an
  export declaring FP8 KV-cache scales), and the scales the MLA attention computes with after loading
  (``_k_scale`` / ``_v_scale``) are compared with the export's per-layer ``self_attn.k_proj.k_scale`` /
  ``v_proj.v_scale``;
* engine-owned parameters: the attention's ``q_scale`` / ``prob_scale`` (created at -1.0, "not loaded";
  ``kv_cache.py BaseKVCacheMethod.process_weights_after_loading`` sets q to the k scale and prob to 1.0 -- no
  ModelOpt export has them), and ``k_scale`` / ``v_scale`` too when the export declares no KV-cache quantization.
"""

from __future__ import annotations

import re
import sys

import _common as C
import vllm_k3
import vllm_qwen3

FUSED = {"fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"), "gate_up_proj": ("gate_proj", "up_proj")}
EXPERT_PROJS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
ATTENTION_SCALES = ("q_scale", "k_scale", "v_scale", "prob_scale")
KV_ATTRS = {"_k_scale": "k", "_v_scale": "v"}


def pieces_of(ours):
    by_name = C.pieces_by_name(ours, FUSED, EXPERT_PROJS)
    return lambda engine_module: by_name(engine_module.removesuffix(".routed_experts"))


def _kv_quantized(export) -> bool:
    return bool(vllm_qwen3._quantization(export).get("kv_cache_quant_algo"))


def owned_of(model, export) -> dict[str, str]:
    kv = _kv_quantized(export)
    owned = {}
    for name, _ in model.named_parameters():
        module, _, attr = name.rpartition(".")
        if attr not in ATTENTION_SCALES or not module.endswith("attn"):
            continue
        if attr in ("q_scale", "prob_scale"):
            owned[name] = ("an attention q/prob scale no ModelOpt export has: created at -1.0 ('not loaded'), set to "
                           "the k scale / 1.0 after loading (kv_cache.py BaseKVCacheMethod)")
        elif not kv:
            owned[name] = ("a KV-cache scale kept at its 'not loaded' -1.0, set to 1.0 after loading (kv_cache.py "
                           "BaseKVCacheMethod; the export declares no KV-cache quantization)")
    return owned


def serve_config(export, model_config) -> dict:
    """The KV-cache dtype ``vllm serve`` gives this export without a flag: ``EngineArgs.create_engine_config``
    resolves ``--kv-cache-dtype auto`` from the checkpoint's quantization config with
    ``utils/torch_utils.py resolve_kv_cache_dtype_string`` (called here, the same function); the driver builds its
    ``VllmConfig`` directly, which would otherwise keep ``auto`` (a BF16 cache, scales forced to 1.0)."""
    from vllm.config import CacheConfig
    from vllm.utils.torch_utils import resolve_kv_cache_dtype_string

    dtype = resolve_kv_cache_dtype_string("auto", model_config)
    return {"cache_config": CacheConfig(cache_dtype=dtype)} if dtype != "auto" else {}


def post_checks(model, ours) -> dict:
    if not any(k.endswith(".k_proj.k_scale") for k in ours):
        return {}
    return C.compare_kv_scales(model, ours, KV_ATTRS)


def by_design(model, ours) -> dict[str, str]:
    """MTP layers (``model.layers.{n}`` for n >= the config's ``num_hidden_layers``, as DeepSeek-V3 and GLM-5 store
    them): both engines' main model skips them (vLLM ``get_spec_layer_idx_from_weight_name``, SGLang's
    ``num_nextn_predict_layers`` check); the MTP drafter, another class, is not run here."""
    n = model.config.num_hidden_layers
    return {k: f"an MTP layer (>= num_hidden_layers {n}): skipped by the main model's load_weights (the drafter's)"
            for k in ours if (m := re.match(r"(?:language_model\.)?model\.layers\.(\d+)\.", k)) and int(m[1]) >= n}


if __name__ == "__main__":
    # SiLU experts: the scale rules are Qwen3-MoE's (no g1_scale_c; it is g1_alphas * a2_gscale, both compared).
    sys.exit(vllm_k3.main(pieces_of=pieces_of, owned_of=owned_of, rules=vllm_qwen3.RULES, serve_config=serve_config,
                          post_checks=post_checks, by_design=by_design))
