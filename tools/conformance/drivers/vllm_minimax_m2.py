"""vLLM's own MiniMax-M2 loading of one export, on CPU; runs inside a vLLM venv (``run.py`` starts it for an
export whose config.json says ``model_type: minimax_m2``).

``vllm_qwen3.py``'s steps, rules and owned parameters (the same ``Attention`` scales, the same ModelOpt methods);
only the names differ: vLLM's MiniMax-M2 keeps the checkpoint's names (``block_sparse_moe``), fuses ``q/k/v_proj``
into ``qkv_proj`` and loads each expert's ``w1``/``w3`` as ``w13`` and ``w2`` as ``w2``
(``models/minimax_m2.py`` ``get_expert_mapping``). Written from that file, not yet run in a vLLM venv.
"""

from __future__ import annotations

import sys

import _common as C
import vllm_k3
import vllm_qwen3

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
EXPERT_PROJS = {"w1": "w1", "w3": "w3", "w2": "w2"}


def pieces_of(ours):
    by_name = C.pieces_by_name(ours, FUSED, EXPERT_PROJS)
    return lambda engine_module: by_name(engine_module.removesuffix(".routed_experts"))


if __name__ == "__main__":
    sys.exit(vllm_k3.main(pieces_of=pieces_of, owned_of=vllm_qwen3.owned_of, rules=vllm_qwen3.RULES))
