"""How each serving engine's Kimi-K2.5 class loads a ModelOpt export: the rules ``modelopt-k3-check`` replays.

Both open engines build Kimi-K2.5's text model with their DeepSeek-V3 class, so the text part is replayed with
DeepSeek-V3's own rules (``models/deepseek_v3/serving.py``, looked up through the registry: one set of rules per
engine class, no copy) on the export as that class sees it; the vision tower and projector are read as stored.
Read from the engines' code as the search tools store it (commits named); observed since with the pinned wheels'
own loaders (vLLM 0.33.0, SGLang 0.5.23, the conformance run of docs/ENGINE_CONFORMANCE.md, cell
``kimi_k25-qformat-nvfp4``): both load the ``--qformat nvfp4`` export byte for byte, as these rules say.

* vLLM (``vllm/model_executor/models/kimi_k25.py`` as in vllm-project/vllm after PR #33346, e.g. the copy with
  ``hf_to_vllm_mapper``): ``KimiK25ForConditionalGeneration`` builds ``language_model`` as the registered
  ``DeepseekV2ForCausalLM`` (``init_vllm_registered_model``, prefix ``language_model``), so its module names are
  the checkpoint's ``language_model.model.layers.N.*`` / ``language_model.lm_head`` and the quant config's
  exclusions are matched against them as written (``hf_to_vllm_mapper`` renames only the legacy
  ``language_model.layers.`` prefix and ``mm_projector.proj.{0,2}`` -> ``linear_{1,2}``); the vision tower and
  projector take the ModelOpt config (``_maybe_ignore_quant_config`` drops only compressed-tensors): the tower is
  unquantized by ModelOpt's ``get_quant_method`` (``vision_tower`` in the name), the projector by an exclusion
  (our exports list ``mm_projector*``). Replayed: DeepSeek-V3's vLLM rules on the export with its text config.
  (The older copy at 009dff4 built ``DeepseekV2Model`` as ``language_model`` and renamed names in
  ``load_weights`` only, so exclusions written in checkpoint names did not match it: not replayed.)
* SGLang (``python/sglang/srt/models/kimi_k25.py`` @ 00a239e): ``KimiK25ForConditionalGeneration`` builds
  ``language_model = DeepseekV3ForCausalLM(text_config, quant_config, prefix="")`` for a ModelOpt config and
  ``load_weights`` hands it every non-vision name with ``language_model.`` removed (after ``hf_to_sglang_mapper``:
  ``language_model.layers.`` -> ``language_model.model.layers.``); the vision tower gets a quant config only for
  ModelSlim, the projector none. Replayed: DeepSeek-V3's SGLang rules on the text part with the prefix removed
  (the quant configs as written: SGLang's exclusion matching sees them so), names given back with the prefix.
* TensorRT-LLM: no ``KimiK25ForConditionalGeneration`` was found in the stored code (a third-party deployment
  recipe patches it onto the DeepSeek-V3 path): not verified.
"""

from __future__ import annotations

from dataclasses import replace

from ...check.layout import Layout, Linear
from ...check.report import EngineResult, not_verified
from ...spec import get_spec

TEXT = "language_model."
VISION = ("vision_tower.", "mm_projector.")
TEXT_ENGINE_MODEL = "deepseek_v3"  # the engines' class for the text model (both build their DeepSeek-V3 class)


def _text_config(layout: Layout) -> dict:
    """The text config as the engine's DeepSeek-V3 class is given it."""
    return {**layout.text_config, "model_type": TEXT_ENGINE_MODEL, "architectures": ["DeepseekV3ForCausalLM"]}


def _rules(engine: str):
    return get_spec(TEXT_ENGINE_MODEL).serving.rules()[engine]


def _strip(name: str) -> str:
    return name.removeprefix(TEXT)


def _sglang_view(layout: Layout) -> Layout:
    """The text part as SGLang's ``DeepseekV3ForCausalLM`` sees it: ``language_model.`` removed from every name."""
    text = lambda names: {_strip(k): v for k, v in names.items() if k.startswith(TEXT)}  # noqa: E731
    linears = {_strip(n): Linear(_strip(n), lin.tensors) for n, lin in layout.linears.items() if n.startswith(TEXT)}
    read = None if layout.read is None else (lambda name, read=layout.read: read(TEXT + name))
    return replace(layout, config=_text_config(layout), linears=linears, kv_scales=text(layout.kv_scales),
                   tensors=text(layout.tensors), read=read,
                   quantized_non_linears=tuple(_strip(n) for n in layout.quantized_non_linears if n.startswith(TEXT)))


def _prefixed(result: EngineResult) -> EngineResult:
    """A result of the text view with the checkpoint's names back."""
    def back(name: str) -> str:
        return name if name == "config.json" or name.startswith(VISION) else TEXT + name

    result.refusals = [replace(r, tensor=back(r.tensor)) for r in result.refusals]
    result.deviations = [replace(d, module=back(d.module)) for d in result.deviations]
    return result


def replay_vllm(layout: Layout, *, numerics: bool = True) -> EngineResult:
    """vLLM's ``KimiK25ForConditionalGeneration`` (module docstring): DeepSeek-V3's rules, names as stored."""
    return _rules("vllm")(replace(layout, config=_text_config(layout)), numerics=numerics)


def replay_sglang(layout: Layout, *, numerics: bool = True) -> EngineResult:
    """SGLang's ``KimiK25ForConditionalGeneration`` (module docstring): DeepSeek-V3's rules on the text part."""
    return _prefixed(_rules("sglang")(_sglang_view(layout), numerics=numerics))


replay_trtllm = not_verified("trtllm", "TensorRT-LLM's Kimi-K2.5 loading was not read (no "
                                       "KimiK25ForConditionalGeneration in the stored code)")


# The spec's ``ServingSpec.rules``: engine -> rules.
SERVING = {"vllm": replay_vllm, "sglang": replay_sglang, "trtllm": replay_trtllm}
