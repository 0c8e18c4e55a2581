"""How each serving engine's MiniMax-M2 class loads a checkpoint: the rules ``modelopt-k3-check`` replays.

Read from the engines' code as the search tools store it (vLLM ``vllm/model_executor/models/minimax_m2.py`` @
01d99586, SGLang ``python/sglang/srt/models/minimax_m2.py`` @ 01b5f572); observed since with the pinned wheels'
own loaders (vLLM 0.33.0, SGLang 0.5.23; docs/ENGINE_CONFORMANCE.md, cell ``minimax_m2-qformat-nvfp4``): both load
the ``--qformat nvfp4`` export byte for byte, as these rules say.

* vLLM: ``MiniMaxM2Attention`` fuses ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj`` (``QKVParallelLinear``,
  with the quant config; ``MiniMaxM2ForCausalLM.packed_modules_mapping`` ``{qkv_proj: [q, k, v]}``), ``o_proj``
  and ``lm_head`` with the quant config; ``MiniMaxM2MoE`` (attribute ``block_sparse_moe``) builds the router
  ``gate`` as an fp32 ``ReplicatedLinear`` with ``quant_config=None``, ``e_score_correction_bias`` fp32, and the
  experts as one ``FusedMoE`` whose ``get_expert_mapping`` reads the checkpoint's ``w1`` (gate) / ``w3`` (up) as
  ``w13`` and ``w2`` as down. No ``hf_to_vllm_mapper``: checkpoint names are the engine's. The block's quant-config
  prefix is ``...layers.N.mlp`` (the constructor's ``prefix=f"{prefix}.mlp"``) while its parameters are
  ``block_sparse_moe.*``: a per-layer entry in a MIXED_PRECISION manifest under ``block_sparse_moe.experts`` would
  not be found there. Exports of the default recipe write none (experts are the global algo), so this is not
  modelled; not verified for per-layer manifests. Layers ``model.layers.{num_hidden_layers + i}`` for
  ``i < num_mtp_modules`` are skipped (spec-decode layers; the stand-in has none).
* SGLang: the same ``qkv_proj`` fusion, the router ``gate`` an fp32 ``ReplicatedLinear`` with ``quant_config=None``,
  ``lm_head`` a ``ParallelLMHead`` with ``quant_config=None`` (always unquantized), experts by
  ``FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="w1", ckpt_down_proj_name="w2", ckpt_up_proj_name="w3")``
  under ``block_sparse_moe`` (its quant prefix too); ``load_weights`` skips names not in ``params_dict``.
* TensorRT-LLM: its MiniMax-M2 loader (``tensorrt_llm/_torch/models/modeling_minimax_m2.py``) was not read:
  ``replay_trtllm`` says "not verified" for every export, never "loads" or "refuses".

KV-cache scales: the spec declares no KV-cache sites (no ``--kv_cache_qformat`` for MiniMax-M2 yet); both engines
would take them on ``self_attn.attn``.
"""

from __future__ import annotations

from ...check.engines.base import Fused, ModelServing, WeightsMapper
from ...check.report import not_verified

EXPERT_RE = r"(?P<module>.+\.block_sparse_moe\.experts)\.(?P<expert>\d+)\.(?P<proj>w[123])"
GATE_UP = ("w1", "w3")  # w13 in both engines' expert mapping
QKV = Fused("qkv_proj", ("q_proj", "k_proj", "v_proj"))
ROUTER = (r"\.block_sparse_moe\.gate$", "{engine}'s MiniMaxM2MoE builds the router gate as an fp32 ReplicatedLinear "
                                        "with quant_config=None (minimax_m2.py MiniMaxM2MoE.__init__)")


def _serving(engine: str, unquantized: tuple[tuple[str, str], ...]) -> ModelServing:
    return ModelServing(
        engine=engine,
        model_type="minimax_m2",
        mapper=WeightsMapper(),
        strip_prefix="",
        fused=(QKV,),
        unquantized=((ROUTER[0], ROUTER[1].format(engine=engine)), *unquantized),
        formats_only=(),
        packed_modules_mapping={"qkv_proj": QKV.pieces},
        expert_re=EXPERT_RE,
        gate_up=GATE_UP,
        kv_scale_params=("attn.k_scale", "attn.v_scale"),
        kv_note=f"{engine}'s MiniMaxM2Attention holds its KV-cache scales on its attention layer (attn)",
    )


VLLM_MINIMAX_M2 = _serving("vllm", ())
SGLANG_MINIMAX_M2 = _serving("sglang", ((r"^lm_head$", "SGLang's MiniMaxM2ForCausalLM builds lm_head as a "
                                                       "ParallelLMHead with quant_config=None (minimax_m2.py)"),))



# TensorRT-LLM: not verified (module docstring).
replay_trtllm = not_verified("trtllm", "TensorRT-LLM's MiniMax-M2 loader was not read by this check")


# The spec's ``ServingSpec.rules``: engine -> rules.
SERVING = {"vllm": VLLM_MINIMAX_M2, "sglang": SGLANG_MINIMAX_M2, "trtllm": replay_trtllm}
