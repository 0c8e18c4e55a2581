"""The experts layer: one base for every model's fused routed experts, and their runtimes.

* ``base``: ``FusedExperts`` (placement, ``place``, the ``down_input_hook`` convention, the eager loop,
  ``combine``); a model supplies its activation, biases and combine order (``models/<model>/experts.py``).
* ``packed``: packed-resident (MXFP4) experts decoded just in time, and ``local_experts_forward``, how
  any experts module runs its local experts under a named implementation.
* ``dispatch``: ``torch_a2a``, the expert-parallel implementation (the exchange itself is ``dist.a2a``).

Layering: this package sits above ``dist/``, ``numerics/`` and ``spec/`` and below ``models/``,
``load``, ``quant/``, ``export/`` and ``report/``; nothing below imports it (docs/decisions/0021-experts-base-and-packed-memory.md,
"Files and layering").
"""

from .base import FusedExperts, combine_fp32

__all__ = ["FusedExperts", "combine_fp32"]
