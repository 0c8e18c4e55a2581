"""What a Nemotron-H config.json must hold, and the checkpoint layout it fixes, as the hub stores it.

The decoder's layout is the generic one (``models/common/layout.py``: transformers' ``NemotronHForCausalLM`` built
on meta), with the hub's spelling: ``backbone.`` for transformers' ``model.``, and each routed expert one
``up_proj`` / ``down_proj`` Linear (non-gated). The layer kinds come from ``hybrid_override_pattern`` (``M``
Mamba-2, ``*`` attention, ``E`` MoE, ``-`` dense MLP), which transformers reads silently; it is checked here
first. The MTP block (``mtp.layers.{j}``, ``mtp_hybrid_override_pattern``) is not built by transformers
(``_keys_to_ignore_on_load_unexpected = ["mtp.*"]``): ``carried_modules`` declares it, so every export carries it
unquantized and the source check holds its tensors to the config.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ...spec import CarriedModules, SpecError
from ...spec.config import positive_int
from ..common.layout import meta_layouts, meta_tensor_shapes

MODEL_CLASS = "NemotronHForCausalLM"
LAYERS = "backbone.layers"
EXPERTS_RE = r"\.mixer\.experts$"
# transformers' fused experts parameter -> the hub's per-expert Linear it stacks (non-gated: one each).
FUSION = {"up_proj": ("up_proj",), "down_proj": ("down_proj",)}
CONFIG_FIELDS = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel")
MOE_CONFIG_FIELDS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "moe_shared_expert_intermediate_size")
LAYOUT_FIELDS = ("hybrid_override_pattern", "hidden_size", "n_routed_experts", "moe_intermediate_size",
                 "moe_latent_size")
PATTERN_RE = re.compile(r"[ME*\-]+")
MTP_REASON = "MTP block (not built by transformers; carried unquantized)"
# The MTP block's own tensors besides its pattern's layers: the fusion of [embedding; hidden] on the first
# layer, the final norm on the last (vLLM's nemotron_h_mtp.py NemotronHMultiTokenPredictor).
MTP_FIRST = ("enorm.weight", "hnorm.weight", "eh_proj.weight")
MTP_LAST = ("final_layernorm.weight",)


def checkpoint_name(name: str) -> str:
    """transformers' tensor name -> the hub's (``model.`` is stored as ``backbone.``)."""
    return "backbone." + name.removeprefix("model.") if name.startswith("model.") else name


def _pattern(config: Mapping[str, Any], key: str) -> str:
    pattern = config.get(key)
    if not isinstance(pattern, str) or not PATTERN_RE.fullmatch(pattern):
        raise SpecError(f"config.json {key} = {pattern!r}; a string of layer kinds M (Mamba-2), * (attention), "
                        "E (MoE), - (MLP) is needed")
    return pattern


def check_config_fields(config: Mapping[str, Any]) -> None:
    pattern = _pattern(config, "hybrid_override_pattern")
    for name in CONFIG_FIELDS + (MOE_CONFIG_FIELDS if "E" in pattern else ()):
        positive_int(config, name)
    layers = config.get("num_hidden_layers")
    if layers is not None and layers != len(pattern):  # transformers ignores it and warns; we refuse
        raise SpecError(f"config.json num_hidden_layers = {layers!r} but hybrid_override_pattern has "
                        f"{len(pattern)} layers ({pattern!r})")
    if config.get("moe_latent_size") is not None:
        positive_int(config, "moe_latent_size")
    mtp = config.get("num_nextn_predict_layers") or 0
    if mtp not in (0, 1):  # vLLM's NemotronHMTP asserts exactly one MTP block
        raise SpecError(f"config.json num_nextn_predict_layers = {mtp!r}; Nemotron-H has 0 or 1 MTP block")
    if mtp:
        _pattern(config, "mtp_hybrid_override_pattern")


EXPERT_LAYOUT, DENSE_LAYOUT = meta_layouts(
    MODEL_CLASS, LAYOUT_FIELDS, EXPERTS_RE, fusion=FUSION, checkpoint_name=checkpoint_name,
    layer_re=rf"{re.escape(LAYERS)}\.(?P<layer>\d+)\.")


def mtp_tensors(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the MTP block and its shape: the decoder layers of ``mtp_hybrid_override_pattern`` (built
    by transformers on meta as a model of that pattern), as ``mtp.layers.{j}``, routed experts per expert."""
    pattern = _pattern(config, "mtp_hybrid_override_pattern")
    mtp_config = {**config, "hybrid_override_pattern": pattern, "num_hidden_layers": len(pattern)}
    out: dict[str, tuple[int, ...]] = {}
    hidden = positive_int(config, "hidden_size")
    out.update((f"mtp.layers.0.{name}", (hidden, 2 * hidden) if name == "eh_proj.weight" else (hidden,))
               for name in MTP_FIRST)
    for name, shape in meta_tensor_shapes(MODEL_CLASS, mtp_config):
        if not name.startswith("model.layers."):
            continue
        mtp_name = "mtp." + name.removeprefix("model.")
        module, _, param = mtp_name.rpartition(".")
        if re.search(EXPERTS_RE, module) and param in FUSION:
            num, rows, cols = shape
            out.update((f"{module}.{e}.{param}.weight", (rows, cols)) for e in range(num))
        else:
            out[mtp_name] = shape
    out.update((f"mtp.layers.{len(pattern) - 1}.{name}", (hidden,)) for name in MTP_LAST)
    return out


def carried_modules(config: Mapping[str, Any]) -> CarriedModules | None:
    """``SourceCheckSpec.carried``: the MTP block (``mtp``), when ``num_nextn_predict_layers`` says there is one."""
    if not config.get("num_nextn_predict_layers"):
        return None
    return CarriedModules(("mtp",), mtp_tensors(config), MTP_REASON)
