"""vLLM's own Qwen3.5-MoE loading of one export, on CPU; runs inside a vLLM venv (``run.py`` starts it for an
export whose config.json says ``model_type: qwen3_5_moe``). Written from vLLM's ``qwen3_5.py`` as read
(``models/qwen3_5_moe/serving.py``); run by ``python -m tools.conformance`` (docs/ENGINE_CONFORMANCE.md).

The same steps as ``vllm_qwen3.py``; the map from vLLM's module names to the export's differs: the VLM's
``hf_to_vllm_mapper`` puts the text model under ``language_model.model.`` (``lm_head`` under ``language_model.``)
and the vision tower under ``visual.``; ``Qwen3_5Model.load_weights`` fuses ``q/k/v_proj`` into ``qkv_proj``, the
shared expert's ``gate/up_proj`` into ``gate_up_proj``, the gated delta net's ``in_proj_qkv``/``in_proj_z`` into
``in_proj_qkvz`` and ``in_proj_b``/``in_proj_a`` into ``in_proj_ba``; the routed experts are one ``FusedMoE`` per
layer (``mlp.experts``) loading each expert's ``gate_proj``/``up_proj`` as ``w13`` and ``down_proj`` as ``w2``.
"""

from __future__ import annotations

import sys

import _common as C
import vllm_k3
import vllm_qwen3

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}
EXPERT_PROJS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# vLLM's name prefix -> the export's (the inverse of Qwen3-VL's hf_to_vllm_mapper).
PREFIXES = (("language_model.model.", "model.language_model."), ("language_model.lm_head", "lm_head"),
            ("visual.", "model.visual."))


def export_name(engine_module: str) -> str:
    name = engine_module.removesuffix(".routed_experts")
    for engine, ours in PREFIXES:
        if name.startswith(engine):
            return ours + name[len(engine):]
    return name


def by_design(model, ours) -> dict[str, str]:
    """The ``mtp.*`` block: both engines' main model skips it by name (vLLM ``skip_prefixes=["mtp."]``, SGLang
    ``load_weights`` ``"mtp" in name``); the MTP drafter, another class, is not run here."""
    return C.skipped_by_prefix(ours, ("mtp.",), "skipped by the main model's load_weights (the MTP drafter's)")


def pieces_of(ours):
    by_name = C.pieces_by_name(ours, FUSED, EXPERT_PROJS)
    return lambda engine_module: by_name(export_name(engine_module))


if __name__ == "__main__":
    sys.exit(vllm_k3.main(pieces_of=pieces_of, owned_of=vllm_qwen3.owned_of, rules=vllm_qwen3.RULES,
                          by_design=by_design))
