"""Header-only full-size Kimi-K3 and DeepSeek-R1 (DeepSeek-V3's layout) for the planners' reference tables.

``python -m modelopt_k3.testing.full_size DIR`` prints docs/MEMORY.md's "How long it takes" table
(``memory.reference_times``), writing the two layouts under ``DIR`` once (a few MB on disk, sparse files).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..memory.inventory import CheckpointLayout, read_layout
from ..memory.reference_times import nvfp4_recipe, reference_table
from .header_only import make_kimi_k3_layout
from .header_only_deepseek_v3 import make_deepseek_v3_layout


def full_size_layouts(workdir: Path) -> dict[str, tuple[CheckpointLayout, str]]:
    """Model name -> (its full-size layout under ``workdir``, the recipe ``--qformat nvfp4`` means for it)."""
    out = {}
    for model, make in (("Kimi-K3", make_kimi_k3_layout), ("DeepSeek-R1", make_deepseek_v3_layout)):
        path = Path(workdir) / model
        layout = read_layout(path if (path / "config.json").exists() else make(path))
        out[model] = (layout, nvfp4_recipe(layout))
    return out


if __name__ == "__main__":
    print(reference_table(full_size_layouts(Path(sys.argv[1]))))
