"""vLLM's own Nemotron-H loading of one export, on CPU; runs inside a vLLM venv (``run.py`` starts it for an
export whose config.json says ``model_type: nemotron_h``).

The same steps as ``vllm_k3.py`` (vLLM's ``ModelConfig`` / ``VllmConfig`` parse the export's configs and pick
the ModelOpt method per layer; its ``DefaultModelLoader`` builds ``NemotronHForCausalLM``, runs its
``load_weights`` and ``process_weights_after_loading``; the same stubs). The map from vLLM's module names to the
export's: the class's ``hf_to_vllm_mapper`` renames ``backbone`` to ``model`` (and drops ``mtp``), fuses
``q/k/v_proj`` into ``qkv_proj``, and loads each MoE layer's non-gated experts into one ``FusedMoE``
(``mixer.experts``) whose ``w1`` is the checkpoint's ``up_proj`` (no ``w3``) and ``w2`` its ``down_proj``.
What the class does on purpose with tensors no parameter holds byte for byte (``by_design``): each Mamba layer's
``A_log`` is loaded as ``A = -exp(A_log.float())`` (vLLM ``mamba_mixer2.py``, SGLang ``attention/mamba/mamba.py``:
the same weight loader), verified value for value; the ``mtp.*`` block is skipped by the main model (loaded by the
MTP drafter, not run here).
"""

from __future__ import annotations

import sys

import _common as C
import torch
import vllm_k3
import vllm_qwen3

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
EXPERT_PROJS = {"w1": "up_proj", "w2": "down_proj"}


def export_name(engine_module: str) -> str:
    """vLLM's module name -> the export's (``model.`` is the checkpoint's ``backbone.``)."""
    name = engine_module.removesuffix(".routed_experts")
    return "backbone." + name.removeprefix("model.") if name.startswith("model.") else name


A_LOG = ".mixer.A_log"
MTP_WHY = "skipped by the main model's load_weights (the MTP drafter's; not run here)"


def by_design(model, ours) -> dict[str, str]:
    """``A_log`` tensors found as the engine's ``A = -exp(A_log.float())``, and the ``mtp.*`` tensors (module
    docstring); the parameter names are the engine's (``model.`` for ``backbone.``, ``A`` for ``A_log``)."""
    params = dict(model.named_parameters())
    found = C.skipped_by_prefix(ours, ("mtp.",), MTP_WHY)
    for name in (k for k in ours if k.endswith(A_LOG)):
        param = "model." + name.removeprefix("backbone.").removesuffix("A_log") + "A"
        found.update(C.transformed_into(ours, params, name, param, lambda t: -torch.exp(t.float()),
                                        f"loaded as {param} = -exp(A_log.float()) (the Mamba mixer's weight loader)"))
    return found


def pieces_of(ours):
    by_name = C.pieces_by_name(ours, FUSED, EXPERT_PROJS)
    return lambda engine_module: by_name(export_name(engine_module))


if __name__ == "__main__":
    sys.exit(vllm_k3.main(pieces_of=pieces_of, owned_of=vllm_qwen3.owned_of, rules=vllm_qwen3.RULES,
                          by_design=by_design))
