"""How a Qwen3.5-MoE checkpoint is laid out, and the view the pipeline reads it through.

The released checkpoints (Qwen/Qwen3.5-35B-A3B, -397B-A17B; Qwen3.6-35B-A3B) are the VLM
``Qwen3_5MoeForConditionalGeneration``: the text model under ``model.language_model.``, the vision tower under
``model.visual.``, ``lm_head`` at the top, and a one-layer MTP block under ``mtp.`` that transformers does not build
(``_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]``). The decoder's routed experts are stored FUSED as
transformers holds them (``mlp.experts.gate_up_proj [E, 2I, H]``, gate rows first; ``mlp.experts.down_proj
[E, H, I]``), the MTP layer's one Linear per expert.

* ``per_expert_view`` (``LoadingSpec.checkpoint_view``): the fused tensors as per-expert ``gate_proj``/``up_proj``/
  ``down_proj`` ``.weight`` byte ranges (E is dim 0 and each expert's ``[2I, H]`` block is contiguous, gate rows
  then up rows), so an expert-parallel rank reads only its experts' bytes and the pipeline sees the per-expert
  names every other model has; transformers' own per-expert merge fuses them again at load.
* ``carried_modules`` (``SourceCheckSpec.carried``): the MTP block, carried into every export as stored.
* ``check_config_fields``: the text_config fields the tools read before transformers would silently default them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ...checkpoint import CheckpointError, TensorInfo
from ...spec import CarriedModules, SpecError
from ...spec.config import positive_int
from ..common.spec import EXPERT_KEY_RE

LAYERS = "model.language_model.layers"
_FUSED_RE = re.compile(r"^(?P<module>model\.language_model\.layers\.\d+\.mlp\.experts)\.(?P<param>gate_up_proj|down_proj)$")
# A fused parameter -> the per-expert Linears it holds, in row order (gate rows first: transformers' Concatenate).
_HELD = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}

TEXT_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
               "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
               "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
LAYOUT_FIELDS = ("num_experts", "moe_intermediate_size", "hidden_size", "num_hidden_layers", "layer_types")
MTP_PREFIX = "mtp"
MTP_REASON = "MTP block (not built by transformers; carried unquantized, as NVIDIA's NVFP4 release keeps it)"


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise SpecError("config.json of a qwen3_5_moe checkpoint has no text_config (the VLM as released has one)")
    return text


def check_config_fields(config: Mapping[str, Any]) -> None:
    text = text_config(config)
    for name in TEXT_FIELDS:
        positive_int(text, name, label=f"config.json text_config.{name}")
    kinds = text.get("layer_types")
    n = text["num_hidden_layers"]
    if kinds is not None and (not isinstance(kinds, list) or len(kinds) != n
                              or not set(kinds) <= {"linear_attention", "full_attention"}):
        raise SpecError(f"config.json text_config.layer_types = {kinds!r}; one of linear_attention/full_attention "
                        f"per layer ({n}) is needed")


def per_expert_view(stored: Mapping[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The checkpoint view (module docstring). A fused tensor that is not ``[E, rows, cols]``, or a stored
    per-expert tensor of a module whose experts are stored fused, is refused naming the stored tensor: planted
    bytes never stand in for an expert's."""
    out: dict[str, TensorInfo] = {}
    fused_modules: dict[str, str] = {}
    for key, info in stored.items():
        m = _FUSED_RE.match(key)
        if m is None:
            out[key] = info
            continue
        held = _HELD[m["param"]]
        if len(info.shape) != 3 or info.shape[1] % len(held):
            raise CheckpointError(f"stored tensor {key} is {list(info.shape)}, not the fused experts layout "
                                  f"[E, {'2I, H' if len(held) == 2 else 'H, I'}] of Qwen3.5-MoE")
        num, rows, cols = info.shape
        per_expert, rows = info.nbytes // num if num else 0, rows // len(held)
        for e in range(num):
            for j, proj in enumerate(held):
                part = per_expert // len(held)
                out[f"{m['module']}.{e}.{proj}.weight"] = TensorInfo(
                    info.file, info.dtype, (rows, cols), part, info.offset + e * per_expert + j * part)
        fused_modules[m["module"]] = key
    expert_key = re.compile(EXPERT_KEY_RE)
    for key in stored:
        m = expert_key.match(key)
        if m is not None and m["module"] in fused_modules:
            raise CheckpointError(f"stored tensor {key} is a per-expert tensor of {m['module']}, whose experts are "
                                  f"stored fused ({fused_modules[m['module']]}); a checkpoint stores them one way")
    return out


def mtp_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the MTP block as the release stores it: ``fc`` over [embedding; hidden], its two input
    norms, ``mtp_num_hidden_layers`` full-attention MoE decoder layers (transformers' own layer built on meta;
    routed experts one Linear per expert) and the final norm."""
    import torch
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

    text = dict(text_config(config))
    hidden, depth = text["hidden_size"], text.get("mtp_num_hidden_layers") or 0
    text.update(num_hidden_layers=1, layer_types=["full_attention"])
    text.pop("model_type", None)
    with torch.device("meta"):
        layer = Qwen3_5MoeDecoderLayer(Qwen3_5MoeTextConfig(**text), 0)
    one: dict[str, tuple[int, ...]] = {}
    for name, t in layer.state_dict().items():
        head, _, param = name.rpartition(".")
        if head == "mlp.experts" and param in _HELD:
            num, rows, cols = t.shape
            one.update((f"{head}.{e}.{proj}.weight", (rows // len(_HELD[param]), cols))
                       for e in range(num) for proj in _HELD[param])
        else:
            one[name] = tuple(t.shape)
    out = {f"{MTP_PREFIX}.fc.weight": (hidden, 2 * hidden), f"{MTP_PREFIX}.pre_fc_norm_embedding.weight": (hidden,),
           f"{MTP_PREFIX}.pre_fc_norm_hidden.weight": (hidden,)}
    for j in range(depth):
        out.update((f"{MTP_PREFIX}.layers.{j}.{name}", shape) for name, shape in one.items())
    out[f"{MTP_PREFIX}.norm.weight"] = (hidden,)
    return out


def carried_modules(config: Mapping[str, Any]) -> CarriedModules | None:
    """``SourceCheckSpec.carried``: the MTP block when the config declares one (``mtp_num_hidden_layers``)."""
    if not text_config(config).get("mtp_num_hidden_layers"):
        return None
    return CarriedModules((MTP_PREFIX,), mtp_shapes(config), MTP_REASON)
