"""How each serving engine's GLM-5 class loads a checkpoint: DeepSeek-V3's rules, by the engines' own inheritance.

Read from the engines' code as the search tools store it, not at the vLLM 0.33.0 / SGLang 0.5.23 tags (re-check
there; facts in docs/decisions/0007-next-models.md):

* vLLM ``vllm/model_executor/models/deepseek_v2.py``: ``class GlmMoeDsaForCausalLM(DeepseekV2ForCausalLM): pass``.
* SGLang ``sglang/srt/models/glm4_moe.py``: ``GlmMoeDsaForCausalLM`` subclasses ``DeepseekV2ForCausalLM``,
  overriding only ``determine_num_fused_shared_experts``.

Observed by the conformance run (tools/conformance, vLLM 0.33.0 / SGLang 0.5.23 on CPU), and replayed here before
DeepSeek-V3's rules: both DeepSeek-V2 classes read config keys that transformers' ``GlmMoeDsaConfig`` does not write
(the released config.json has them; an export copies its source's): vLLM creates the router's
``e_score_correction_bias`` only for ``topk_method: noaux_tc`` (``deepseek_v2.py`` ``DeepseekV2MoE``), so a config
without it meets the stored bias with a ``KeyError`` in ``load_weights``; SGLang's ``_is_layer_sparse`` reads
``moe_layer_freq`` while building the layers (``AttributeError`` without it).

So both engines load a GLM-5 export with their DeepSeek-V2/V3 loader, and the DeepSeek-V3 spec's rules (its
``ServingSpec.rules``, looked up in the spec registry: no model package imports another) are replayed for them:
MLA fusions, the router, MTP layers skipped by the main model and loaded by the drafter, ``kv_b_proj``. Not
modelled: SGLang's ``determine_num_fused_shared_experts`` override (the shared-expert fusion decision; the default
recipe keeps shared experts and routed experts apart only by format, which the DeepSeek-V3 rule refuses as
unsettled where it applies), the indexer modules' quant method (the default recipe keeps them BF16 and excludes
them). TensorRT-LLM: its GLM-5 support was not read: "not verified".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ...check.layout import Layout
from ...check.report import EngineResult, Refusal, not_verified
from ...spec import get_spec

# TensorRT-LLM: not verified (module docstring).
replay_trtllm = not_verified("trtllm", "TensorRT-LLM's GLM-5 (glm_moe_dsa) loader was not read by this check")


EXPERTS = re.compile(r"(.+\.layers\.\d+\.mlp)\.experts\.\d+\.")


def _layer_index(block: str) -> int:
    return int(block.split(".layers.")[1].split(".")[0])


def missing_config(engine: str, layout: Layout) -> Refusal | None:
    """The engine's DeepSeek-V2 class needs a config key the export's config.json lacks (module docstring)."""
    config = layout.text_config
    if engine == "vllm" and config.get("topk_method") != "noaux_tc":
        # Every GLM-5 router stores the bias (transformers' GlmMoeDsa routes noaux_tc only): one per MoE block, found
        # by its experts' Linears (a planned layout lists Linears only, and the router is none there).
        blocks = sorted({m[1] for k in layout.linears if (m := EXPERTS.match(k))}, key=_layer_index)
        if blocks:
            return Refusal(f"{blocks[0]}.gate.e_score_correction_bias", "vLLM 0.33.0's DeepseekV2MoE creates the router's e_score_correction_bias only for "
                                    f"topk_method 'noaux_tc' (config.json: {config.get('topk_method')!r}): the stored "
                                    "bias has no parameter (KeyError in load_weights)")
    if engine == "sglang" and "moe_layer_freq" not in config:
        return Refusal("config.json", "SGLang 0.5.23's DeepseekV2Model reads config.moe_layer_freq while building its "
                                      "layers (_is_layer_sparse); this config.json has none (AttributeError)")
    return None


def with_config_rule(engine: str, rules):
    """``rules`` (DeepSeek-V3's for ``engine``) preceded by ``missing_config``."""

    def replay(layout: Layout, *, numerics: bool = True) -> EngineResult:
        result = rules(layout, numerics=numerics)
        refusal = missing_config(engine, layout)
        if refusal is not None:
            result.refusals.insert(0, refusal)
        return result

    replay.__qualname__ = f"glm_moe_dsa[{engine}]"
    return replay


_RULES: dict[str, Any] = {}


def serving() -> Mapping[str, Any]:
    """engine -> rules: vLLM's and SGLang's are DeepSeek-V3's (module docstring), built once."""
    if not _RULES:
        deepseek = get_spec("deepseek_v3").serving.rules()
        _RULES.update(vllm=with_config_rule("vllm", deepseek["vllm"]),
                      sglang=with_config_rule("sglang", deepseek["sglang"]), trtllm=replay_trtllm)
    return _RULES
