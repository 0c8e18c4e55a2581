"""vLLM's own Nemotron-H loading of one export, on CPU; runs inside a vLLM venv (``run.py`` starts it for an
export whose config.json says ``model_type: nemotron_h``).

The same steps as ``vllm_k3.py`` (vLLM's ``ModelConfig`` / ``VllmConfig`` parse the export's configs and pick
the ModelOpt method per layer; its ``DefaultModelLoader`` builds ``NemotronHForCausalLM``, runs its
``load_weights`` and ``process_weights_after_loading``; the same stubs). The map from vLLM's module names to the
export's: the class's ``hf_to_vllm_mapper`` renames ``backbone`` to ``model`` (and drops ``mtp``), fuses
``q/k/v_proj`` into ``qkv_proj``, and loads each MoE layer's non-gated experts into one ``FusedMoE``
(``mixer.experts``) whose ``w1`` is the checkpoint's ``up_proj`` (no ``w3``) and ``w2`` its ``down_proj``.
Not run in the session that wrote it (no vLLM venv there): its first run is the first observation.
"""

from __future__ import annotations

import sys

import _common as C
import vllm_k3
import vllm_qwen3

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
EXPERT_PROJS = {"w1": "up_proj", "w2": "down_proj"}


def export_name(engine_module: str) -> str:
    """vLLM's module name -> the export's (``model.`` is the checkpoint's ``backbone.``)."""
    name = engine_module.removesuffix(".routed_experts")
    return "backbone." + name.removeprefix("model.") if name.startswith("model.") else name


def pieces_of(ours):
    by_name = C.pieces_by_name(ours, FUSED, EXPERT_PROJS)
    return lambda engine_module: by_name(export_name(engine_module))


if __name__ == "__main__":
    sys.exit(vllm_k3.main(pieces_of=pieces_of, owned_of=vllm_qwen3.owned_of, rules=vllm_qwen3.RULES))
