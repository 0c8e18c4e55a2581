"""How each serving engine's Nemotron-H class loads a checkpoint: the rules ``modelopt-k3-check`` replays.

Read from the PyPI wheels vLLM 0.33.0 and SGLang 0.5.23 (and the same in their main branches as the search tools
store them: vLLM @ 00b08dc, SGLang @ 02c6032).

* vLLM 0.33.0 ``vllm/model_executor/models/nemotron_h.py``: ``NemotronHForCausalLM.hf_to_vllm_mapper`` renames the
  prefix ``backbone`` -> ``model``, drops ``mtp`` (the main model never sees the MTP block), and the substrings
  ``A_log`` -> ``A``, ``embeddings`` -> ``embed_tokens``; it stacks ``q_proj``/``k_proj``/``v_proj`` into
  ``qkv_proj`` (``packed_modules_mapping``: only ``qkv_proj``). ``NemotronHMoE``: the router ``gate`` is a
  ``GateLinear`` built without the quant config (fp32 output); ``fc1_latent_proj``/``fc2_latent_proj`` are
  ``ReplicatedLinear`` and the shared expert a ``NemotronHMLP`` (``up_proj``/``down_proj``), all built WITH the
  quant config; the routed experts one non-gated ``FusedMoE`` over the latent width (``ckpt_names = ("up_proj",
  "down_proj", None)``: ``w1`` is ``up_proj``, no ``w3``). Mamba layers are ``MambaMixer2``
  (``layers/mamba/mamba_mixer2.py``): ``in_proj``/``out_proj`` with the quant config, ``conv1d`` a Linear built
  with ``quant_config=None``; attention ``qkv_proj``/``o_proj`` with it; ``lm_head`` a ``ParallelLMHead`` with it.
* SGLang 0.5.23 ``sglang/srt/models/nemotron_h.py``: ``hf_to_sglang_mapper`` ``backbone.`` -> ``model.`` (what
  its ModelOpt config applies to the exclude list); ``load_weights`` also rewrites ``A_log``/``embeddings`` and
  skips every name containing ``mtp`` unless it is the MTP draft (``is_mtp``); ``stacked_params_mapping`` and
  ``packed_modules_mapping`` only ``qkv_proj``. ``NemotronHMoE``: the router ``gate`` a ``ReplicatedLinear`` with
  ``quant_config=None``; latent projections and the shared expert with the quant config; experts non-gated
  (``is_gated=False``; ``make_expert_params_mapping(ckpt_gate_proj_name="up_proj", ckpt_up_proj_name="")``);
  ``MambaMixer2`` (``layers/attention/mamba/mamba.py``) as vLLM's: ``conv1d`` with ``quant_config=None``.
  Observed (tools/conformance, SGLang 0.5.23 on CPU): its ``NemotronHConfig`` reads the Mamba group count from
  ``mamba_n_groups`` (default 8) while transformers' config -- and so every config.json ours copies -- writes
  ``n_groups``; ``MambaMixer2`` is built with ``mamba_n_groups`` groups, so a checkpoint whose ``n_groups`` is not
  that number stops in ``load_weights`` (``conv1d`` shard sizes, ``linear.py`` ``weight_loader``: "start + length
  exceeds dimension size"). The released Nemotron-3 checkpoints have 8 groups, which is why they load.
* TensorRT-LLM: its Nemotron-H loader was not read: not verified (the check refuses to say "loads").

Not verified on either engine: the MTP drafter's load of ``mtp.*`` (vLLM ``nemotron_h_mtp.py``, SGLang
``load_weights(is_mtp=True)``); the replay reports it as a warning. Our exports keep the MTP block BF16 and name
it in the exclusions (``mtp*``), which is what vLLM's ``NemotronHMTP.hf_to_vllm_mapper`` needs to leave it
unquantized (0007). KV-cache scales: the spec declares no KV-cache sites, so an export holds none.
"""

from __future__ import annotations

from dataclasses import replace

from ...check.engines.base import Fused, ModelServing, WeightsMapper
from ...check.engines.sglang import SGLANG
from ...check.engines.vllm import VLLM
from ...check.layout import Layout
from ...check.report import EngineResult, Refusal, not_verified

EXPERT_RE = r"(?P<module>.+\.mixer\.experts)\.(?P<expert>\d+)\.(?P<proj>up_proj|down_proj)"
W1_ONLY = ("up_proj", "")  # non-gated: w1 is the up projection, there is no w3
QKV = Fused("qkv_proj", ("q_proj", "k_proj", "v_proj"))
ROUTER = r"\.mixer\.gate$"
CONV1D = r"\.mixer\.conv1d$"
MTP_PREFIX = "mtp."

VLLM_NEMOTRON_H = ModelServing(
    engine="vllm",
    model_type="nemotron_h",
    mapper=WeightsMapper(prefixes={"backbone.": "model."}, substrs={"A_log": "A", "embeddings": "embed_tokens"}),
    strip_prefix="",
    fused=(QKV,),
    unquantized=((ROUTER, "vLLM's Nemotron-H router is a GateLinear built without the quant config "
                          "(nemotron_h.py NemotronHMoE.__init__)"),
                 (CONV1D, "vLLM's MambaMixer2 builds conv1d with quant_config=None (mamba_mixer2.py)")),
    formats_only=(),
    packed_modules_mapping={"qkv_proj": QKV.pieces},
    expert_re=EXPERT_RE,
    gate_up=W1_ONLY,
    kv_scale_params=("attn.k_scale", "attn.v_scale"),
    kv_note="vLLM's NemotronHAttention holds its KV-cache scales on its Attention layer (attn)",
)

SGLANG_NEMOTRON_H = ModelServing(
    engine="sglang",
    model_type="nemotron_h",
    mapper=WeightsMapper(prefixes={"backbone.": "model."}),
    strip_prefix="",
    fused=(QKV,),
    unquantized=((ROUTER, "SGLang's Nemotron-H router is a ReplicatedLinear built with quant_config=None "
                          "(nemotron_h.py NemotronHMoE.__init__)"),
                 (CONV1D, "SGLang's MambaMixer2 builds conv1d with quant_config=None (attention/mamba/mamba.py)")),
    formats_only=(),
    packed_modules_mapping={"qkv_proj": QKV.pieces},
    expert_re=EXPERT_RE,
    gate_up=W1_ONLY,
    kv_scale_params=("attn.k_scale", "attn.v_scale"),
    kv_note="SGLang's NemotronHAttention holds its KV-cache scales on its RadixAttention (attn)",
)


SGLANG_MAMBA_GROUPS_DEFAULT = 8  # sglang/srt/configs/nemotron_h.py NemotronHConfig(mamba_n_groups=8)


def sglang_mamba_groups(layout: Layout) -> Refusal | None:
    """SGLang builds every Mamba mixer with ``mamba_n_groups`` groups (default 8), not the ``n_groups`` the
    checkpoint's tensors are shaped by (module docstring): a mismatch is refused at the first ``conv1d``."""
    config = layout.text_config
    built = config.get("mamba_n_groups", SGLANG_MAMBA_GROUPS_DEFAULT)
    stored = config.get("n_groups", built)
    # Mamba mixers by their in_proj Linear (a planned layout lists Linears only; conv1d is no Linear).
    mixers = sorted(k.removesuffix(".in_proj") for k in layout.linears
                    if k.endswith(".mixer.in_proj") and not k.startswith(MTP_PREFIX))
    if stored == built or not mixers:
        return None
    return Refusal(f"{mixers[0]}.conv1d.weight", f"SGLang 0.5.23's NemotronHConfig builds each MambaMixer2 with mamba_n_groups = {built} "
                            f"(config.json has {'no mamba_n_groups: its default' if 'mamba_n_groups' not in config else 'it'}"
                            f"), but the checkpoint's Mamba tensors have n_groups = {stored}: its conv1d/in_proj shard "
                            "sizes do not fit (RuntimeError in load_weights; add mamba_n_groups to config.json)")


def _without_mtp(layout: Layout) -> tuple[Layout, list[str]]:
    """``layout`` without the MTP block's Linears (both engines' main models skip ``mtp.*``), and their names."""
    mtp = sorted(k for k in layout.linears if k.startswith(MTP_PREFIX))
    if not mtp:
        return layout, []
    return replace(layout, linears={k: v for k, v in layout.linears.items() if k not in set(mtp)}), mtp


def _replay(engine, serving: ModelServing, drafter: str, layout: Layout, numerics: bool) -> EngineResult:
    kept, mtp = _without_mtp(layout)
    result = engine.replay(kept, serving, numerics=numerics)
    if mtp:
        result.warnings.append(f"the MTP block ({len(mtp)} Linears under mtp.): skipped by the main model's "
                               f"load_weights; the MTP drafter's load ({drafter}) is not verified by this check")
    return result


def replay_vllm(layout: Layout, *, numerics: bool = True) -> EngineResult:
    """vLLM's ``NemotronHForCausalLM`` (module docstring)."""
    return _replay(VLLM, VLLM_NEMOTRON_H, "nemotron_h_mtp.py NemotronHMTP", layout, numerics)


def replay_sglang(layout: Layout, *, numerics: bool = True) -> EngineResult:
    """SGLang's ``NemotronHForCausalLM`` (module docstring)."""
    result = _replay(SGLANG, SGLANG_NEMOTRON_H, "load_weights(is_mtp=True)", layout, numerics)
    groups = sglang_mamba_groups(layout)
    if groups is not None:
        result.refusals.insert(0, groups)
    return result


# TensorRT-LLM: not verified (its Nemotron-H loader was not read); never said to load.
replay_trtllm = not_verified("trtllm", "not verified: modelopt-k3-check has not read TensorRT-LLM's Nemotron-H "
                                       "loader, so it does not say this export loads there")


# The spec's ``ServingSpec.rules``: engine -> rules.
SERVING = {"vllm": replay_vllm, "sglang": replay_sglang, "trtllm": replay_trtllm}
