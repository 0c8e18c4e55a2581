"""Is an export complete for the model its config.json builds? Every tensor the model's modules need, by name.

Before the engine replays say "loads", the check builds the export's own model class on the meta device (the
spec's class; transformers' own classes run no checkpoint code, a remote-code class is not built here) and asks,
from headers only, for every parameter and persistent buffer it holds: a dense one under its own name (a
quantized Linear keeps ``<name>.weight``, or ``weight_packed``), a routed expert's projection under its
per-expert name. An export with a router, a ``q_norm`` or an expert bias deleted is then refused by name.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import CheckpointError, CheckpointReader, read_config
from ..spec import SpecError, get_spec

__all__ = ["IncompleteExport", "missing_tensors"]

_SHOWN = 12


class IncompleteExport(CheckpointError):
    """The export lacks tensors its model needs (named)."""


def _expected(path: Path, raw: dict, reader) -> tuple[set[str], list[tuple[str, int, tuple[str, ...]]]] | None:
    """(dense names, [(experts module, num experts, projections)]) of the export's model, or None when its
    class runs checkpoint code (not built without the user's trust)."""
    from ..load.pretrained import _build_on_meta, _config_dtype, _sharded_expert_params, persistent_tensors

    try:
        spec = get_spec(str(raw.get("model_type", "")))
    except SpecError:
        return None
    if spec.loading.model_class.remote_code:
        return None
    model_cls, config = spec.loading.model_class.resolve(path, raw, trust_remote_code=False)
    # The export's reader: what is stored decides the ties (tied embeddings without lm_head.weight), as on load.
    model = _build_on_meta(model_cls, config, _config_dtype(config), reader, spec)
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
