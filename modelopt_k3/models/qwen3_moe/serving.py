"""How each serving engine's Qwen3-MoE class loads a checkpoint: the rules ``modelopt-k3-check`` replays.

* vLLM 0.33.0 (the PyPI wheel): ``vllm/model_executor/models/qwen3_moe.py``. ``Qwen3MoeAttention.__init__``
  fuses ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj`` (``QKVParallelLinear``); ``Qwen3MoeMLP`` (the
  ``mlp_only_layers`` / off-``decoder_sparse_step`` layers) fuses ``gate_proj``/``up_proj`` into
  ``gate_up_proj``; ``Qwen3MoeModel.hf_to_vllm_mapper`` keeps the checkpoint's names otherwise;
  ``Qwen3MoeForCausalLM.packed_modules_mapping`` has ``qkv_proj``, plus ``gate_up_proj`` only when
  ``mlp_only_layers`` is set (``__init__``); ``Qwen3MoeSparseMoeBlock.__init__`` builds the router
  ``GateLinear`` *with* the quant config (a ``ReplicatedLinear``: unquantized only when excluded) and the
  experts as one ``FusedMoE`` loading the checkpoint's per-expert ``gate_proj``/``up_proj`` as ``w13`` and
  ``down_proj`` as ``w2``.
* SGLang 0.5.23 (the PyPI wheel): ``sglang/srt/models/qwen3_moe.py``. ``Qwen3MoeAttention.__init__``
  ``qkv_proj``; ``Qwen3MoeSparseMoeBlock.__init__`` builds the router ``gate`` as a ``ReplicatedLinear``
  with ``quant_config=None`` unless the config is ``modelslim``; ``Qwen3MoeForCausalLM.packed_modules_mapping``
  ``{qkv_proj, gate_up_proj}``; ``load_weights``: ``stacked_params_mapping`` (qkv, gate_up) and
  ``FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
  ckpt_up_proj_name="up_proj")``; names not in ``params_dict`` are skipped.
* TensorRT-LLM: no rules here (``modelopt-k3-check`` says it knows none for ``qwen3_moe``).

KV-cache scales: the Qwen3-MoE spec declares no KV-cache sites (no ``--kv_cache_qformat`` for it yet), so an
export holds none; the parameters below are where both engines' ``Attention``/``RadixAttention`` would take them.
"""

from __future__ import annotations

from ...check.engines import register_serving
from ...check.engines.base import Fused, ModelServing, WeightsMapper

EXPERT_RE = r"(?P<module>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>(?:gate|up|down)_proj)"
GATE_UP = ("gate_proj", "up_proj")  # w13 in both engines' make_expert_params_mapping
QKV = Fused("qkv_proj", ("q_proj", "k_proj", "v_proj"))
DENSE_GATE_UP = Fused("gate_up_proj", GATE_UP)

VLLM_QWEN3_MOE = ModelServing(
    engine="vllm",
    model_type="qwen3_moe",
    mapper=WeightsMapper(),
    strip_prefix="",
    fused=(QKV, DENSE_GATE_UP),
    unquantized=(),
    formats_only=(),
    # The class's packed_modules_mapping; gate_up_proj is added by __init__ only for a config with
    # mlp_only_layers, but it only matters where a dense Qwen3MoeMLP exists, which needs exactly that
    # (or a decoder_sparse_step > 1, where vLLM's per-shard lookup then uses the pieces' own names).
    packed_modules_mapping={"qkv_proj": QKV.pieces, "gate_up_proj": GATE_UP},
    expert_re=EXPERT_RE,
    gate_up=GATE_UP,
    kv_scale_params=("attn.k_scale", "attn.v_scale"),
    kv_note="vLLM's Qwen3MoeAttention holds its KV-cache scales on its Attention layer (attn)",
)

SGLANG_QWEN3_MOE = ModelServing(
    engine="sglang",
    model_type="qwen3_moe",
    mapper=WeightsMapper(),
    strip_prefix="",
    fused=(QKV, DENSE_GATE_UP),
    unquantized=(
        (r"\.mlp\.gate$", "SGLang's Qwen3-MoE router is a ReplicatedLinear built with quant_config=None "
                          "(qwen3_moe.py Qwen3MoeSparseMoeBlock.__init__; only modelslim configs quantize it)"),
    ),
    formats_only=(),
    # Qwen3MoeForCausalLM.packed_modules_mapping (the loader seeds the quant config's mapping from the class).
    packed_modules_mapping={"qkv_proj": QKV.pieces, "gate_up_proj": GATE_UP},
    expert_re=EXPERT_RE,
    gate_up=GATE_UP,
    kv_scale_params=("attn.k_scale", "attn.v_scale"),
    kv_note="SGLang's Qwen3MoeAttention holds its KV-cache scales on its RadixAttention (attn)",
)

register_serving("qwen3_moe", "vllm", VLLM_QWEN3_MOE)
register_serving("qwen3_moe", "sglang", SGLANG_QWEN3_MOE)
