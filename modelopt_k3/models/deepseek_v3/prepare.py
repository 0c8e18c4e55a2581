"""Prepare transformers' own DeepSeek-V3 classes for our loader: the source format and its conversion.

Nothing of transformers is edited. ``prepare`` reads which source format the checkpoint declares
(``source_kind``); ``checkpoint_converters`` (the spec's conversion mapping) is the experts chain for it
(``common/compressed_sources.experts_converters``: transformers' ``qwen2_moe`` stacking with the decode in front), so a rank
decodes only its own experts' bytes, straight into its rows. The experts' placement is the generic one
(``models/common/experts.py``).
"""

from __future__ import annotations

from ...spec import PrepareContext, SpecError
from ..common.compressed_sources import experts_converters, source_kind
from ..common.spec import eager_experts


def prepare(ctx: PrepareContext) -> None:
    kind = source_kind(ctx.config)
    if ctx.packed_experts and kind != "int4":
        raise SpecError(f"the routed experts are stored packed but config.json declares a {kind} source")
    eager_experts(ctx)


def checkpoint_converters(ctx: PrepareContext) -> list:
    """The spec's conversion mapping (``LoadingSpec.converters``): the experts chain for the declared source."""
    return experts_converters(source_kind(ctx.config), ctx.config)

