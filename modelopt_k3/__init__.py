"""modelopt_k3: expert-parallel post-training quantization of Kimi-K3-class MoE checkpoints.

Public API (imported lazily so ``import modelopt_k3`` stays cheap)::

    load_pretrained(path, *, plan="auto", trust_remote_code=False, dtype=None) -> model
    load_recipe(name_or_path) -> Recipe
    quantize(model, recipe, forward_loop) -> model
    export_checkpoint(model, export_dir, *, format="modelopt") -> Path
    convert_checkpoint(src, dst, recipe, *, rank=0, world_size=1, resume=True) -> report
    plan_memory(path, *, world_size, gpu_mem_gib=None, batch_size=4, calib_seq=2048, recipe=...) -> MemoryReport
    check_export(export_dir, engines=("vllm", "sglang")) -> CheckReport (per-engine verdicts)
    report(model, out_dir, *, held_out=None, ...) -> report data (rank 0): the quantization report
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_API = {
    "load_pretrained": "modelopt_k3.load",
    "load_recipe": "modelopt_k3.recipe",
    "quantize": "modelopt_k3.quant.api",
    "export_checkpoint": "modelopt_k3.export.model_export",
    "convert_checkpoint": "modelopt_k3.convert",
    "plan_memory": "modelopt_k3.memory.planner",
    "check_export": "modelopt_k3.check",
    "report": "modelopt_k3.report",  # the package's ``report`` (the package module is callable too)
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'modelopt_k3' has no attribute {name!r}")
