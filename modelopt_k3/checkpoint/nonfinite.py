"""Values that are not numbers in a source checkpoint or in calibration: found, named, refused.

Every path that reads source tensors (``CheckpointReader`` for ``load_pretrained`` and the export, the
streaming converter's shard jobs) checks the bytes it has just read (``numerics.finite``): NaN/Inf in a
floating tensor, and E8M0 scale bytes 255 (NaN by the OCP MX spec) in an MXFP4 ``weight_scale``. They
are refused by default, naming each tensor and the count. ``--allow_nonfinite_passthrough`` lets
tensors that are copied unchanged (left unquantized) through with a warning; a tensor that would be
quantized, cast or decoded is always refused: its output would be NaN scales and codes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch import Tensor

from ..numerics.finite import e8m0_nan_count, nonfinite_count

__all__ = ["PASSTHROUGH_FLAG", "NonFiniteError", "describe", "invalid_values", "source_refusal", "warn_passthrough"]

log = logging.getLogger("modelopt_k3")
PASSTHROUGH_FLAG = "--allow_nonfinite_passthrough"
_SHOWN = 8


class NonFiniteError(ValueError):
    """Tensors hold NaN/Inf (or NaN scales); ``found`` maps each tensor name to what was found."""

    def __init__(self, what: str, found: Mapping[str, str], fix: str) -> None:
        self.found = dict(sorted(found.items()))
        super().__init__(f"{what}: {describe(self.found)}; {fix}")


def invalid_values(key: str, tensor: Tensor) -> str | None:
    """What in source tensor ``key`` is not a number ("3 NaN/Inf values"), or None when all are."""
    if tensor.dtype.is_floating_point:
        n = nonfinite_count(tensor)
        return f"{n} NaN/Inf value{'s' if n != 1 else ''}" if n else None
    if key.endswith(".weight_scale") and str(tensor.dtype) == "torch.uint8":  # MXFP4 E8M0 block scales
        n = e8m0_nan_count(tensor)
        return f"{n} E8M0 scale byte{'s' if n != 1 else ''} 255 (NaN)" if n else None
    return None


def describe(found: Mapping[str, str]) -> str:
    items = [f"{key} ({what})" for key, what in sorted(found.items())]
    more = f" and {len(items) - _SHOWN} more tensor(s)" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def source_refusal(found: Mapping[str, str], *, passthrough_possible: bool = True) -> NonFiniteError:
    """The error for non-finite source tensors."""
    fix = "fix or replace the checkpoint"
    if passthrough_possible:
        fix += f" ({PASSTHROUGH_FLAG} copies tensors that stay unquantized through unchanged)"
    return NonFiniteError(f"the source checkpoint holds values that are not numbers in {len(found)} tensor(s)",
                          found, fix)


def warn_passthrough(found: Mapping[str, str]) -> None:
    if found:
        log.warning("modelopt_k3: %s: passing %d tensor(s) with non-finite values through unchanged: %s",
                    PASSTHROUGH_FLAG, len(found), describe(found))
