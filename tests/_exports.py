"""Read an export back independently of the package (safetensors' own ``safe_open`` over the index): every
tensor by key, and the index and the shards must list the same keys.

    from _exports import read_export
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def read_export(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((Path(path) / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for file in sorted(set(index.values())):
        with safe_open(Path(path) / file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[key] = f.get_tensor(key)
    assert set(out) == set(index), "index and shard contents differ"
    return out
