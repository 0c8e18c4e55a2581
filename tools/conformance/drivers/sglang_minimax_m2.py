"""SGLang's own MiniMax-M2 loading of one export, on CPU; runs inside an SGLang venv (``run.py`` starts it for an
export whose config.json says ``model_type: minimax_m2``).

``sglang_qwen3.py``'s steps and stubs; SGLang's MiniMax-M2 keeps the checkpoint's names (``block_sparse_moe``),
fuses ``q/k/v_proj`` into ``qkv_proj`` and loads each expert's ``w1``/``w3`` as ``w13``, ``w2`` as ``w2``
(``models/minimax_m2.py`` ``load_weights``). ``--moe-runner-backend`` stays at its default ``auto``. Written from
that file, not yet run in an SGLang venv.
"""

from __future__ import annotations

import sys

import _common as C
import sglang_k3
import sglang_qwen3

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
EXPERT_PROJS = {"w1": "w1", "w3": "w3", "w2": "w2"}


def pieces_of(ours):
    return C.pieces_by_name(ours, FUSED, EXPERT_PROJS)


if __name__ == "__main__":
    sys.exit(sglang_k3.main(sglang_qwen3.DEFAULTS, pieces_of, sglang_qwen3.apply_stubs))
