"""Import shims for Kimi-K3's remote code across transformers releases.

Each shim only makes a name importable where the remote code expects it; none changes what the model
computes. They are applied before the checkpoint's modeling files are imported.
"""

from __future__ import annotations

import importlib


def _alias(module_name: str, name: str, *sources: tuple[str, str]) -> None:
    module = importlib.import_module(module_name)
    if hasattr(module, name):
        return
    for src_module, src_name in sources:
        try:
            value = getattr(importlib.import_module(src_module), src_name)
        except (ImportError, AttributeError):
            continue
        setattr(module, name, value)
        return


def apply_import_shims() -> None:
    # Upstream imports PytorchGELUTanh, renamed GELUTanh in newer releases.
    _alias("transformers.activations", "PytorchGELUTanh", ("transformers.activations", "GELUTanh"))
    # OutputRecorder moved from utils.generic (4.5x) to utils.output_capturing (5.x); make both work.
    _alias("transformers.utils.generic", "OutputRecorder", ("transformers.utils.output_capturing", "OutputRecorder"))
