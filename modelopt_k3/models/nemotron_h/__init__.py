"""Nemotron-H, the latent-MoE variant (``model_type: nemotron_h``: Nemotron-3 Super/Ultra), on transformers' own
``NemotronH*`` classes: hybrid Mamba-2 / attention / MoE decoder layers (``hybrid_override_pattern``), BF16 source.

Built by ``models/common``'s ``transformers_moe_spec``. What is Nemotron-H's own (``model.py``): the decoder held
under the hub's ``backbone.`` name, and the non-gated experts (relu2, working in the latent width between
``fc1_latent_proj``/``fc2_latent_proj``) on our experts base with their gate hook, which transformers' own
grouped_mm path does not call for non-gated experts; the Mamba-2 widths of its probe; the MTP block carried
unquantized (``source_layout.py``). Mamba and attention layers go through the generic machinery: their Linears are
ordinary dense modules, and on CPU the Mamba-2 mixer runs transformers' PyTorch scan. Facts:
docs/decisions/0007-next-models.md, docs/decisions/0014-nemotron-h.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...spec import ExpertProjection, ExpertsSpec, RecipesSpec, ServingSpec, SourceCheckSpec, register_spec
from ..common.lazy import lazy_attrs
from ..common.spec import TransformersSubclass, transformers_moe_spec
from .memory import activation_memory
from .model import (
    EXPERTS_CLASS,
    MODEL_CLASS,
    checkpoint_converters,
    place_experts,
    prepare,
    probe_model,
)
from .source_layout import (
    DENSE_LAYOUT,
    EXPERT_LAYOUT,
    EXPERTS_RE,
    LAYERS,
    carried_modules,
    check_config_fields,
)

# Per-expert checkpoint Linears of the decoder's MoE layers (the MTP block's are carried as stored, never read as
# experts: the loader, the planner and EP see only the decoder's).
EXPERT_KEY_RE = (r"^(?P<module>backbone\.layers\.\d+\.mixer\.experts)\.(?P<expert>\d+)\.(?P<proj>up_proj|down_proj)"
                 r"\.(?P<tensor>\w+)$")


def serving_rules() -> Mapping[str, Any]:
    """``ServingSpec.rules``: built from ``check/``'s classes, so imported when a check first asks."""
    from .serving import SERVING

    return SERVING


def make_stand_in(path: str | Path, **sizes: Any) -> Path:
    """``ModelSpec.stand_in``: the tiny Nemotron-H (``testing/nemotron_h.py``)."""
    from ...testing.nemotron_h import make_tiny_nemotron_h

    return make_tiny_nemotron_h(path, **sizes)


NEMOTRON_H_SPEC = register_spec(
    transformers_moe_spec(
        "nemotron_h", "NemotronHForCausalLM",
        model_source=TransformersSubclass(MODEL_CLASS),
        prepare=prepare,
        converters=checkpoint_converters,
        # The router's score-correction bias decides which experts run: kept fp32 as stored (transformers keeps
        # it fp32 too: _keep_in_fp32_modules_strict).
        loading={"keep_source_dtype": r"\.gate\.e_score_correction_bias$"},
        experts_spec=ExpertsSpec(
            module_regex=EXPERTS_RE,
            sharded_params={"gate_up_proj": 0, "down_proj": 0},
            # Non-gated: the up projection is the whole first fused parameter (one weight_scale_2 / input_scale).
            projections=(ExpertProjection("up_proj", "gate_up_proj"), ExpertProjection("down_proj", "down_proj")),
            num_experts_attr="n_routed_experts",
            key_regex=EXPERT_KEY_RE,
            place_experts=place_experts,
        ),
        quant={"probe_model": probe_model},
        layers=LAYERS,
        activation_memory=activation_memory,
        source_check=SourceCheckSpec(expert_layout=EXPERT_LAYOUT, dense_layout=DENSE_LAYOUT,
                                     check_config=check_config_fields, carried=carried_modules),
        recipes=RecipesSpec(
            qformat={"nvfp4": "models/nvidia/Nemotron-3/nvfp4_experts"},
            converter=None,
            no_converter_reason="its routed experts are BF16, so NVFP4 input scales need calibration",
        ),
        serving=ServingSpec(rules=serving_rules),
        stand_in=make_stand_in,
    ),
)

# Made on first use: they subclass transformers' modeling classes, imported when a model is built.
__getattr__ = lazy_attrs(__name__, {"NemotronHBackboneForCausalLM": MODEL_CLASS, "NemotronHFusedExperts": EXPERTS_CLASS})

__all__ = ["NEMOTRON_H_SPEC", "NemotronHBackboneForCausalLM", "NemotronHFusedExperts"]
