"""How each serving engine's Qwen3.5-MoE class loads a checkpoint: the rules ``modelopt-k3-check`` replays.

Read from the engines' sources as stored by the search tools (the commits named below; that these are the code
of the pinned wheels, vLLM 0.33.0 and SGLang 0.5.23, was not verified):

* vLLM (``vllm/model_executor/models/qwen3_5.py`` @ 00def4f, ``qwen3_next.py`` @ 002d607):
  ``Qwen3_5MoeForConditionalGeneration`` loads through ``AutoWeightsLoader(skip_prefixes=["mtp."])`` with the
  Qwen3-VL ``hf_to_vllm_mapper`` (``model.language_model.`` -> ``language_model.model.``, ``model.visual.`` ->
  ``visual.``, ``lm_head.`` -> ``language_model.lm_head.``), which its ModelOpt config also applies to
  ``exclude_modules``. ``Qwen3_5Model.load_weights`` stacks ``q/k/v_proj`` -> ``qkv_proj``, ``gate/up_proj`` ->
  ``gate_up_proj`` (the shared expert, ``Qwen2MoeMLP``), ``in_proj_qkv`` + ``in_proj_z`` -> ``in_proj_qkvz`` and
  ``in_proj_b`` + ``in_proj_a`` -> ``in_proj_ba`` (``Qwen3_5ForCausalLMBase.packed_modules_mapping``); routed
  experts per expert (``FusedMoE`` ``w13``/``w2``; a fused ``experts.gate_up_proj`` is accepted too).
  ``Qwen3NextSparseMoeBlock`` builds the router ``gate`` and ``shared_expert_gate`` as ``ReplicatedLinear`` with
  ``quant_config=None``. The vision tower (``Qwen3_VisionTransformer``) is built WITH the quant config: an export
  keeping it BF16 must exclude it (``model.visual*``, as ours and NVIDIA's do). ``mtp.*`` is skipped by the main
  model (the MTP drafter is a separate class, not replayed here).
* SGLang (``python/sglang/srt/models/qwen3_5.py`` @ 005fa71): ``Qwen3_5GatedDeltaNet`` builds ``in_proj_qkvz``
  and ``in_proj_ba`` with the quant config (packed-checkpoint loaders split ``in_proj_qkv``/``in_proj_z`` and
  ``in_proj_b``/``in_proj_a`` into them) and ``conv1d`` without; the rest is replayed as the vLLM rules' data under
  SGLang's prefixes, the vision tower unquantized, plus the deepstack default (``sglang_deepstack``), as SGLang
  0.5.23's own loader did on CPU (decision 0017).
* TensorRT-LLM: its Qwen3.5-MoE loader was not read; "not verified" too.
"""

from __future__ import annotations

from dataclasses import replace

from ...check.engines.base import Fused, ModelServing, WeightsMapper
from ...check.layout import Layout
from ...check.report import Deviation, EngineResult, not_verified

EXPERT_RE = r"(?P<module>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>(?:gate|up|down)_proj)"
GATE_UP = ("gate_proj", "up_proj")
QKV = Fused("qkv_proj", ("q_proj", "k_proj", "v_proj"))
SHARED_GATE_UP = Fused("gate_up_proj", GATE_UP)
GDN_QKVZ = Fused("in_proj_qkvz", ("in_proj_qkv", "in_proj_z"))
GDN_BA = Fused("in_proj_ba", ("in_proj_b", "in_proj_a"))
FUSED = (QKV, SHARED_GATE_UP, GDN_QKVZ, GDN_BA)
PACKED = {f.engine_name: f.pieces for f in FUSED}
# Qwen3VLForConditionalGeneration.hf_to_vllm_mapper (inherited by Qwen3_5MoeForConditionalGeneration).
VL_MAPPER = WeightsMapper(prefixes={"model.language_model.": "language_model.model.", "model.visual.": "visual.",
                                    "lm_head.": "language_model.lm_head."})
ROUTERS = (
    (r"\.mlp\.gate$", "the router is a ReplicatedLinear built with quant_config=None (qwen3_next.py "
                      "Qwen3NextSparseMoeBlock)"),
    (r"\.mlp\.shared_expert_gate$", "the shared-expert gate is a ReplicatedLinear built with quant_config=None "
                                    "(qwen3_next.py Qwen3NextSparseMoeBlock)"),
)

VLLM_QWEN3_5_MOE = ModelServing(
    engine="vllm",
    model_type="qwen3_5_moe",
    mapper=VL_MAPPER,
    strip_prefix="",
    fused=FUSED,
    unquantized=ROUTERS,
    formats_only=(),
    packed_modules_mapping=PACKED,
    expert_re=EXPERT_RE,
    gate_up=GATE_UP,
    kv_scale_params=("attn.k_scale", "attn.v_scale"),
    kv_note="vLLM's Qwen3NextAttention holds its KV-cache scales on its Attention layer (attn)",
)

# SGLang's module prefixes, as its quant config sees them (hf_to_sglang_mapper None): model.language_model. ->
# model. (Qwen3_5MoeForCausalLM under model), model.visual. -> visual.; attention keeps self_attn in its prefix
# (get_layer's add_prefix("self_attn", ...)) though load_weights drops it from parameter names.
SGLANG_MAPPER = WeightsMapper(prefixes={"model.language_model.": "model.", "model.visual.": "visual."})
# The vLLM rules' data under SGLang's names: its prefixes, the vision tower unquantized, no packed-modules map.
SGLANG_QWEN3_5_MOE = replace(
    VLLM_QWEN3_5_MOE,
    engine="sglang",
    mapper=SGLANG_MAPPER,
    unquantized=(*ROUTERS, (r"^model\.visual\.", "SGLang's Qwen3VLForConditionalGeneration builds the vision tower with "
                                                   "quant_config=None (qwen3_vl.py; Qwen3.5-MoE's class derives from it)")),
    packed_modules_mapping=None,
    kv_note="SGLang's Qwen3.5 attention holds its KV-cache scales on its RadixAttention (attn)",
)
# SGLang's Qwen3-VL vision config (configs/qwen3_vl.py) defaults deepstack_visual_indexes to [8, 16, 24]; Qwen3.5's
# release config.json says [] (no deepstack mergers), transformers' Qwen3_5MoeVisionConfig writes no such key.
SGLANG_DEEPSTACK_DEFAULT = (8, 16, 24)


def sglang_deepstack(layout: Layout) -> Deviation | None:
    """A vision config without ``deepstack_visual_indexes``: SGLang builds that many deepstack mergers, which no
    checkpoint tensor fills (observed: their parameters are never written), and feeds them into image inputs."""
    vision = layout.config.get("vision_config")
    if not isinstance(vision, dict) or "deepstack_visual_indexes" in vision:
        return None
    return Deviation("visual.deepstack_merger_list",
                     f"vision_config has no deepstack_visual_indexes: SGLang 0.5.23 defaults it to "
                     f"{list(SGLANG_DEEPSTACK_DEFAULT)} and builds {len(SGLANG_DEEPSTACK_DEFAULT)} deepstack mergers no "
                     "checkpoint tensor fills (never written; image inputs only; the release config says [])",
                     float("nan"))


def replay_sglang(layout: Layout, *, numerics: bool = True) -> EngineResult:
    """SGLang's ``Qwen3_5MoeForConditionalGeneration`` (module docstring): the vLLM rules' data under SGLang's
    names, and the deepstack default."""
    from ...check.engines.sglang import SGLANG

    result = SGLANG.replay(layout, SGLANG_QWEN3_5_MOE, numerics=numerics)
    deepstack = sglang_deepstack(layout)
    if deepstack is not None:
        result.deviations.append(deepstack)
    return result


# The spec's ``ServingSpec.rules``: engine -> rules.
SERVING = {
    "vllm": VLLM_QWEN3_5_MOE,
    "sglang": replay_sglang,
    "trtllm": not_verified("trtllm", "not verified: TensorRT-LLM's Qwen3.5-MoE loader was not read; "
                                     "modelopt-k3-check guesses no verdict for this engine and model"),
}
