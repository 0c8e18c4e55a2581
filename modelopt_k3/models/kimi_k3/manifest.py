"""How the engines spell Kimi-K3's modules when they look a ModelOpt MIXED_PRECISION manifest up.

Each engine asks ``quantized_layers`` / ``exclude_modules`` about its own runtime names (the rules are
cited in ``serving.py``, one snapshot per engine):

* TensorRT-LLM's K3 loader asks for each layer's routed-expert *bank*, ``<prefix>layers.{i}.<suffix>``
  with prefix ``language_model.model.``, ``model.`` or none and suffix ``block_sparse_moe.experts`` or
  ``mlp.experts``; per-expert entries are never read.
* SGLang 0.5.23 builds the language model with prefix ``""`` (``model.layers.{i}...``) and renames
  ``block_sparse_moe`` to ``mlp``; its lookup does not add ``language_model.`` back.
* vLLM 0.33.0 keeps ``language_model.model.layers.{i}.block_sparse_moe``.
* The fused attention parameters: SGLang ``fused_qkvg_proj`` (KDA q/k/v/g) and
  ``fused_qkv_a_proj_with_mqa`` (MLA q_a/kv_a); vLLM ``in_proj_qkvgfab`` (KDA q/k/v/g/f_a/b),
  ``fused_qkv_a_proj`` and, with ``mla_use_output_gate``, ``fused_qkv_a_g_proj`` (MLA q_a/kv_a(/g)).

ModelOpt's own Kimi-K3 converter (NVIDIA/Model-Optimizer 575c27ae ``examples/kimi/kimi_k3/
quantize_to_nvfp4.py``) writes the same spellings; ``tests/data/modelopt_kimi_k3_converter`` holds
its manifests for the tiny model, and our manifest must contain every entry and pattern of them.
"""

from __future__ import annotations

from ...spec import ManifestNaming

LM = "language_model."
LM_MODEL = "language_model.model."


def aliases(name: str) -> list[str]:
    """``name`` first, then ``block_sparse_moe`` as ``mlp``, each without ``language_model.model.`` and with
    ``model.`` instead (a name directly under ``language_model.``, e.g. ``lm_head``, without that prefix)."""
    names = [name] + ([name.replace("block_sparse_moe", "mlp")] if "block_sparse_moe" in name else [])
    out = list(names)
    for n in names:
        if n.startswith(LM_MODEL):
            rest = n[len(LM_MODEL):]
            out += [f"model.{rest}", rest]
        elif n.startswith(LM):
            out.append(n[len(LM):])
    return list(dict.fromkeys(out))


KIMI_K3_MANIFEST = ManifestNaming(
    aliases=aliases,
    expert_bank_regex=r"(?P<bank>.+\.block_sparse_moe\.experts)\.\d+\.w[123]",
    fused=(
        ("fused_qkvg_proj", ("q_proj", "k_proj", "v_proj", "g_proj")),  # SGLang KDA
        ("in_proj_qkvgfab", ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")),  # vLLM KDA
        ("fused_qkv_a_proj_with_mqa", ("q_a_proj", "kv_a_proj_with_mqa")),  # SGLang MLA
        ("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa")),  # vLLM MLA
        ("fused_qkv_a_g_proj", ("q_a_proj", "kv_a_proj_with_mqa", "g_proj")),  # vLLM MLA with output gate
    ),
    # What Kimi-K3 keeps BF16 whatever the recipe (router, latent and shared experts, short convs, norms,
    # attention-residual projections, the dense layer-0 MLP, lm_head, vision): the patterns ModelOpt's K3
    # converter writes, so an engine that matches them by pattern sees the same exclusions.
    never_quantized=(
        "*block_sparse_moe.gate*",
        "*block_sparse_moe.routed_expert_up_proj*",
        "*block_sparse_moe.routed_expert_down_proj*",
        "*block_sparse_moe.routed_expert_norm*",
        "*block_sparse_moe.shared_experts*",
        "*self_attn.q_conv1d*",
        "*self_attn.k_conv1d*",
        "*self_attn.v_conv1d*",
        "*self_attn.f_b_proj*",
        "*self_attn.o_norm*",
        "*self_attn.q_a_layernorm*",
        "*self_attn.kv_a_layernorm*",
        "*_res_proj*",
        "*_res_norm*",
        "*layernorm*",
        "language_model.model.layers.0.mlp.*",
        "language_model.lm_head",
        "vision_tower*",
        "mm_projector*",
    ),
)
