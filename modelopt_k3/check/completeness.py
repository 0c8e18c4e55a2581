"""Is an export complete for the model its config.json builds? Every tensor the model's modules need, by name.

Before the engine replays say "loads", the check builds the export's own model class on the meta device (the
spec's class; transformers' own classes run no checkpoint code, a remote-code class is not built here) and asks,
from headers only, for every parameter and persistent buffer it holds: a dense one under its own name (a
quantized Linear keeps ``<name>.weight``, or ``weight_packed``), a routed expert's projection under its
per-expert name. An export with a router, a ``q_norm`` or an expert bias deleted is then refused by name.

Its per-tensor scales are checked too (``check_scales``): a ``weight_scale_2``, ``input_scale``, FP8 per-tensor
``weight_scale`` or KV-cache ``k_scale``/``v_scale`` that is 0, negative or not finite loads in every engine and
serves zeros or NaN (a 0 global scale dequantizes the whole weight to 0), so no engine is said to load it.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..checkpoint import CheckpointError, CheckpointReader, read_config
from ..spec import SpecError, get_spec

__all__ = ["DegenerateScales", "IncompleteExport", "check_scales", "degenerate_scales", "missing_tensors"]

# Scales that hold one value per tensor (or per expert) and divide or multiply the whole weight or activation.
PER_TENSOR_SCALES = ("weight_scale_2", "input_scale", "k_scale", "v_scale")

_SHOWN = 12


class IncompleteExport(CheckpointError):
    """The export lacks tensors its model needs (named)."""


class DegenerateScales(CheckpointError):
    """Per-tensor scales of the export are 0, negative or not finite (named, with their values)."""


def _expected(path: Path, raw: dict, reader) -> tuple[set[str], list[tuple[str, int, tuple[str, ...]]]] | None:
    """(dense names, [(experts module, num experts, projections)]) of the export's model, or None when its
    class runs checkpoint code (not built without the user's trust)."""
    try:
        spec = get_spec(str(raw.get("model_type", "")))
    except SpecError:
        return None
    if spec.loading.model_class.remote_code:
        return None
    # Imported only when a model is built here (the loader imports transformers' experts interface, ~0.5 s).
    from ..load.pretrained import _build_on_meta, _sharded_expert_params, persistent_tensors
    from ..spec.config import load_dtype

    model_cls, config = spec.loading.model_class.resolve(path, raw, trust_remote_code=False)
    # The export's reader: what is stored decides the ties (tied embeddings without lm_head.weight), as on load.
    model = _build_on_meta(model_cls, config, load_dtype(config), reader, spec)
    fused, _ = _sharded_expert_params(model, spec)  # the stored-fused ones (biases) are dense names here
    dense = {name for name in persistent_tensors(model) if name not in fused}
    experts = []
    for name, module in spec.experts_modules(model).items():
        first = spec.experts.projections[0].fused_param
        experts.append((name, getattr(module, first).shape[0], tuple(p.name for p in spec.experts.projections)))
    return dense, experts


def missing_tensors(export_dir: str | Path, reader: CheckpointReader) -> list[str] | None:
    """The tensors the export's model needs that ``reader`` (the export's) lacks, or None when the model is not
    built here."""
    path = Path(export_dir)
    raw = read_config(path)
    stored = set(reader.names())
    expected = _expected(path, raw, reader)
    if expected is None:
        return None
    dense, experts = expected
    missing = []
    for name in sorted(dense):
        if name in stored:
            continue
        if name.endswith(".weight") and f"{name}_packed" in stored:
            continue
        missing.append(name)
    for module, n, projections in experts:
        for e in range(n):
            for proj in projections:
                key = f"{module}.{e}.{proj}.weight"
                if key not in stored and f"{key}_packed" not in stored:
                    missing.append(key)
    return missing


def check_complete(export_dir: str | Path, reader: CheckpointReader) -> None:
    """Refuse an export missing what its model needs, naming the tensors (``IncompleteExport``)."""
    missing = missing_tensors(export_dir, reader)
    if missing:
        more = f" … and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else ""
        raise IncompleteExport(f"{export_dir} is incomplete: the model its config.json builds needs {len(missing)} "
                               f"tensor(s) it does not store: {', '.join(missing[:_SHOWN])}{more}; no engine loads it")


def _is_per_tensor_scale(name: str, numel: int) -> bool:
    part = name.rsplit(".", 1)[-1]
    return part in PER_TENSOR_SCALES or (part == "weight_scale" and numel == 1)  # FP8 per-tensor weight scale


def degenerate_scales(reader: CheckpointReader) -> list[str]:
    """``name = value`` of every per-tensor scale (``PER_TENSOR_SCALES``; an FP8 weight's one-element
    ``weight_scale``) that is not a positive finite number; block scales (an all-zero block is legal) are
    not read."""
    bad = []
    for name, info in sorted(reader.headers().items()):
        if not info.dtype.is_floating_point or not _is_per_tensor_scale(name, math.prod(info.shape)):
            continue
        values = reader.get(name).float()
        wrong = ~(torch.isfinite(values) & (values > 0))
        if wrong.any():
            bad.append(f"{name} = {values[wrong].flatten()[0].item():g}")
    return bad


def check_scales(export_dir: str | Path, reader: CheckpointReader) -> None:
    """Refuse an export whose per-tensor scales an engine would serve as zeros or NaN (``DegenerateScales``)."""
    bad = degenerate_scales(reader)
    if bad:
        more = f" … and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
        raise DegenerateScales(f"[per-tensor-scale-degenerate] {export_dir} has {len(bad)} per-tensor scale(s) that "
                               "are not positive finite numbers: "
                               f"{', '.join(bad[:_SHOWN])}{more}; an engine loads them and serves zeros or NaN")
