"""Row-slab iteration so CPU kernels keep their temporaries cache resident.

The numerics are vectorized torch ops. On CPU, a chain of ~10 elementwise ops over a 3072x3584
matrix is bound by memory traffic and page faults of fresh 44 MB temporaries; running the same
chain over slabs of ~128K elements keeps every temporary in L2 and is several times faster. Other
devices get a single slab (one launch per op). The loop is over large row slabs, never over
quantization blocks or elements.
"""

from __future__ import annotations

import torch

SLAB_ELEMS = 1 << 17


def row_slabs(n_rows: int, row_len: int, device: torch.device) -> list[slice]:
    """Slices of rows covering ``range(n_rows)``: one slice off CPU, ~SLAB_ELEMS elements each on CPU."""
    if device.type != "cpu" or n_rows * row_len <= SLAB_ELEMS:
        return [slice(0, n_rows)]
    step = max(1, SLAB_ELEMS // max(row_len, 1))
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]
