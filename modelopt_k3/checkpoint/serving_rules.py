"""The serving failures users report, each a named rule, and the ones an export's own files decide.

Every rule has a name, the verdict the engine really gives (not always a refusal: vLLM loads a missing expert
``input_scale`` as uninitialised memory and serves garbage without a word), the engine function it comes from and
what users saw (``docs/SERVING_RULES.md`` is this table, tested equal). ``modelopt-k3-check`` reports a finding
under its rule's name; the exporters run the *export-side* rules (``export_side``: decided by the export's files
alone, no engine replay) on the staged directory and refuse to publish it, naming the rule
(``refuse_unservable``).

This module sits with the checkpoint reader (below ``export`` and ``convert``, which call it before they publish);
the engine replays (``modelopt_k3.check``) attach the remaining rules' findings to their verdicts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..spec import SpecError, get_spec
from .reader import CheckpointError, CheckpointReader, read_json

# Verdicts, most severe first: what a user meets when an engine is pointed at the export.
CANNOT_START = "server cannot start"
REFUSES = "refuses"
GARBAGE = "loads silently but serves garbage"
NO_DRAFTER = "loads, but the MTP drafter does not load"
# The check has no rule it could observe for that engine and model (its loader was not read): neither "loads" nor
# "refuses" is claimed.
NOT_VERIFIED = "not verified"
DIFFERENT = "loads but serves different numbers"
WARNS = "loads correctly, with a warning"
LOADS = "loads correctly"
SEVERITY = (CANNOT_START, REFUSES, GARBAGE, NO_DRAFTER, NOT_VERIFIED, DIFFERENT, WARNS, LOADS)
ALL_ENGINES = ("vllm", "sglang", "trtllm")


@dataclass(frozen=True)
class ServingRule:
    """One serving failure, as the engines produce it."""

    name: str
    verdict: str  # one of SEVERITY
    engines: tuple[str, ...]
    source: str  # engine, version, file and function the rule is read from
    reported: str  # what users saw, and where
    test: str  # the test that plants the failure into real exports (tests/...::name)
    export_side: bool = False  # decided by the export's files alone: the exporters refuse to publish on it


_VLLM, _SGLANG, _TRT = "vLLM 0.33.0 (PyPI wheel)", "SGLang 0.5.23 (PyPI wheel)", "TensorRT-LLM (code index, main)"
_T = "tests/check/test_serving_rules.py::"

RULES: dict[str, ServingRule] = {r.name: r for r in (
    ServingRule(
        "tokenizer-missing", CANNOT_START, ALL_ENGINES,
        f"{_VLLM} renderer ``from_config`` -> ``cached_get_tokenizer`` (unless --skip-tokenizer-init); {_SGLANG} "
        f"``TokenizerManager.__init__`` -> ``get_tokenizer``; {_TRT} ``llmapi/tokenizer.py tokenizer_factory``: each "
        "loads the tokenizer from the model directory before any weight",
        "issue 41 (server cannot start on a weights-only export)", f"{_T}test_tokenizer_missing", export_side=True),
    ServingRule(
        "sidecar-dropped", DIFFERENT, ALL_ENGINES,
        f"{_VLLM} ``ModelConfig.get_diff_sampling_param`` (generation_config.json defaults) and the chat template "
        "from the tokenizer/processor files; SGLang and TensorRT-LLM read the same files",
        "ModelOpt #2060, vLLM #46641 (silently different generations)", f"{_T}test_sidecar_dropped",
        export_side=True),
    ServingRule(
        "mtp-layers-missing", NO_DRAFTER, ALL_ENGINES,
        f"{_VLLM} ``model_executor/models/deepseek_mtp.py DeepSeekMTP.load_weights`` (reads model.layers.{{n+j}} "
        "from the same checkpoint); SGLang ``deepseek_nextn.py``, TensorRT-LLM's MTP spec_config likewise",
        "vLLM #35548 (the drafter runs on uninitialised weights, acceptance ~0)", f"{_T}test_mtp_layers_missing",
        export_side=True),
    ServingRule(
        "mtp-drafter-format", NO_DRAFTER, ("vllm", "sglang"),
        f"{_VLLM} ``deepseek_mtp.py DeepSeekMTP`` builds the MTP layer with the checkpoint's quant config "
        "(exclusions included); SGLang ``deepseek_nextn.py`` likewise: an MTP layer stored in another format than "
        "its config resolves to fails to load",
        "ModelOpt #2427, vLLM #44087 (MTP quantized but still excluded: the drafter does not load)",
        f"{_T}test_mtp_quantized_but_excluded"),
    ServingRule(
        "block-scale-nonfinite", GARBAGE, ALL_ENGINES,
        "every engine copies NVFP4 E4M3 block scales (and MXFP4 E8M0, block-FP8 fp32 scales) as stored "
        "(vLLM ``ModelOptNvFp4FusedMoE.create_weights`` weight loaders, SGLang ``ModelOptNvFp4FusedMoEMethod``, "
        "TensorRT-LLM ``load_expert_w3_w1_weight_scale_nvfp4``); a NaN block makes its 16 weights NaN",
        "issue 41 (tokens routed to the expert give NaN)", f"{_T}test_block_scale_nan", export_side=True),
    ServingRule(
        "activation-scale-implausible", WARNS, ALL_ENGINES,
        "every engine quantizes activations with the stored input_scale as it is (vLLM "
        "``ModelOptNvFp4LinearMethod.process_weights_after_loading``); nothing checks its size",
        "issue 41 (a withdrawn community export wrote amax/6 for NVFP4 input_scale: 448x too coarse)",
        f"{_T}test_input_scale_x448_warns"),
    ServingRule(
        "trtllm-fc31-scales", REFUSES, ("trtllm",),
        f"{_TRT} ``_torch/modules/fused_moe/quantization.py`` NVFP4 fused-MoE methods "
        "``load_expert_fc31_alpha_nvfp4`` / ``load_expert_fc31_input_scale_nvfp4``: assert w1 and w3 equal",
        "issue 41 (Kimi-K3 converter export said to load; builds that reconcile with max() mis-scale half of w13)",
        f"{_T}test_k3_trtllm_w1_w3_scales_differ"),
    ServingRule(
        "input-scale-missing", GARBAGE, ("vllm",),
        f"{_VLLM} ``modelopt.py ModelOptNvFp4FusedMoE.create_weights``: w13/w2 ``input_scale`` parameters made with "
        "``torch.empty``; a checkpoint without them leaves them unwritten, and ``process_weights_after_loading`` "
        "takes their max over experts",
        "vLLM #45212 (missing expert input scales: NaN or garbage, no error)", f"{_T}test_expert_input_scale_missing"),
    ServingRule(
        "scale-dtype-converted", GARBAGE, ("vllm", "sglang"),
        f"{_VLLM} ``parameter.py`` weight loaders ``param.data.copy_(loaded_weight)`` (SGLang the same): a scale "
        "stored in another dtype is converted by value, so a uint8 E4M3 block scale becomes the integers 0..255",
        "issue 41 (a weight_scale stored uint8 loads and serves garbage)", f"{_T}test_block_scale_stored_uint8"),
    ServingRule(
        "fp8-weight-scale-missing", GARBAGE, ("vllm",),
        f"{_VLLM} ``modelopt.py ModelOptFp8LinearMethod.create_weights`` fills ``weight_scale`` with "
        "``finfo(float32).min`` and the model's ``load_weights`` skips a name that has no parameter: an FP8 scale "
        "under another prefix never arrives and the weight is served with that value",
        "issue 41 (an FP8 key with the wrong prefix loads and serves garbage)", f"{_T}test_fp8_scale_wrong_prefix"),
    # Flagged before issue 41, named here.
    ServingRule(
        "w13-scale-2-read-with-w1s", DIFFERENT, ("vllm", "sglang"),
        f"{_VLLM} ``modelopt.py ModelOptNvFp4FusedMoE.process_weights_after_loading`` (``w13_weight_scale_2[:, 0]``, "
        f"a warning when w3's differs); {_SGLANG} ``modelopt_quant.py ModelOptNvFp4FusedMoEMethod`` likewise",
        "vLLM #54974 (gate/up weight_scale_2 mismatch on hf_ptq exports: half of w13 mis-scaled)",
        "tests/check/test_engines.py::test_vllm_reading_of_unshared_w1_w3_scales_differs_and_the_check_says_so"),
    ServingRule(
        "fused-scales-max", DIFFERENT, ("vllm", "sglang"),
        f"{_VLLM} ``ModelOptNvFp4LinearMethod.process_weights_after_loading`` (weight_scale_2/input_scale: the max "
        "over the shards, block scales unchanged) and FP8 ``requantize_with_max_scale``; SGLang the same",
        "issue 41 (q/k/v FP8 written with three weight_scales: 5.9% element error)",
        "tests/check/test_fused_rules.py::test_fused_pieces_with_different_input_scales_serve_different_numbers"),
    ServingRule(
        "per-tensor-scale-degenerate", GARBAGE, ALL_ENGINES,
        "every engine copies per-tensor scales as stored and multiplies or divides by them (vLLM "
        "``process_weights_after_loading`` of the ModelOpt methods); ``modelopt-k3-check`` stops with an error "
        "naming them (``check/completeness.py check_scales``)",
        "vLLM #45212 (missing, zero, NaN or inf expert input scales: zeros or NaN served)",
        "tests/faults/test_faults_tool_inputs.py::test_a_degenerate_global_scale_is_never_said_to_load"),
)}


@dataclass(frozen=True)
class Finding:
    """One rule broken at ``where`` (a tensor, a module or a file of the export)."""

    rule: str
    where: str
    what: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.where}: {self.what}"


class UnservableExport(CheckpointError):
    """An export that breaks an export-side serving rule (the message names the rule)."""


# ---------------------------------------------------------------------------------------------- sidecar files

# One of these holds every Hugging Face tokenizer the engines load from a model directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")
# What a source's directory holds besides weights and configs that changes how the served model generates.
SIDECARS = {
    "generation config": ("generation_config.json",),
    "chat template": ("chat_template.jinja", "chat_template.json"),
    "processor config": ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json"),
}
# Source directories a served model reads (transformers' tokenizers load named chat templates from
# ``additional_chat_templates/``): the writers carry their files too (``export.writer.copy_side_files``).
SIDECAR_DIRS = ("additional_chat_templates",)


def _has_chat_template_key(directory: Path) -> bool:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return False
    data = read_json(path)
    return isinstance(data, dict) and bool(data.get("chat_template"))


def sidecar_findings(export_dir: Path, source: Path | None = None) -> list[Finding]:
    """No tokenizer (every engine loads one before any weight); with ``source``, each sidecar kind the source has
    and the export lacks (a chat template may also live in tokenizer_config.json)."""
    out = []
    if not any((export_dir / f).is_file() for f in TOKENIZER_FILES):
        out.append(Finding("tokenizer-missing", str(export_dir),
                           f"none of {', '.join(TOKENIZER_FILES)}: the engines load the tokenizer from the model "
                           "directory and the server does not start (unless given --tokenizer elsewhere)"))
    if source is None:
        return out
    for kind, names in SIDECARS.items():
        had = [n for n in names if (source / n).is_file()]
        if had and not any((export_dir / n).is_file() for n in names):
            out.append(Finding("sidecar-dropped", had[0], f"the source has its {kind}, the export does not: served "
                                                          "with the engine's defaults instead"))
    for folder in SIDECAR_DIRS:
        had = sorted(p.name for p in (source / folder).glob("*") if p.is_file()) if (source / folder).is_dir() else []
        lost = [n for n in had if not (export_dir / folder / n).is_file()]
        if lost:
            out.append(Finding("sidecar-dropped", f"{folder}/{lost[0]}", f"the source has {len(had)} file(s) in "
                                                                         f"{folder}/, the export lacks {len(lost)}"))
    if _has_chat_template_key(source) and not _has_chat_template_key(export_dir) and not any(
            (export_dir / n).is_file() for n in SIDECARS["chat template"]):
        out.append(Finding("sidecar-dropped", "tokenizer_config.json", "the source's tokenizer_config.json holds a "
                                                                       "chat_template, the export has none"))
    return out


# ---------------------------------------------------------------------------------------------------- MTP layers


def mtp_findings(config: dict, stored: set[str]) -> list[Finding]:
    """The MTP layers config.json declares (the spec's carried modules) that the export does not store."""
    try:
        spec = get_spec(str(config.get("model_type", "")))
    except SpecError:
        return []
    if spec.source_check.carried is None:
        return []
    carried = spec.source_check.carried(config)
    if carried is None:
        return []
    n = config.get("num_nextn_predict_layers")
    out = []
    for prefix in carried.prefixes:
        wanted = [k for k in carried.tensors if k.startswith(f"{prefix}.")]
        missing = [k for k in wanted if k not in stored and f"{k}_packed" not in stored]
        if missing:
            what = "holds no tensor" if len(missing) == len(wanted) else f"lacks {len(missing)} of its tensors " \
                                                                         f"(e.g. {missing[0]})"
            out.append(Finding("mtp-layers-missing", prefix,
                               f"config.json declares num_nextn_predict_layers = {n}, but the export {what}: an "
                               "engine serving with MTP speculative decoding builds the drafter and loads nothing "
                               "into it (acceptance ~0)"))
    return out


# ------------------------------------------------------------------------------------------------- block scales

CHUNK_BYTES = 64 * 2**20  # bytes read at a time: what the block-scale scan holds, whatever the tensor's size


def _block_scale_keys(reader: CheckpointReader) -> Iterator[tuple[str, str]]:
    """(key, encoding) of every block-scale tensor: E4M3 (NVFP4), E8M0 bytes (MXFP4 beside weight_packed),
    fp32 blocks (FP8_PB_WO, 4-D)."""
    headers = reader.headers()
    for key, info in headers.items():
        if not key.endswith(".weight_scale") or not info.shape:
            continue
        if info.dtype == torch.float8_e4m3fn:
            yield key, "e4m3"
        elif info.dtype == torch.uint8 and f"{key[:-len('weight_scale')]}weight_packed" in headers:
            yield key, "e8m0"
        elif info.dtype == torch.float32 and len(info.shape) == 4:
            yield key, "fp32"


def _bad_count(chunk: torch.Tensor, encoding: str) -> int:
    """NaN/Inf entries of one chunk. Byte encodings through numpy (a max first, a count only when it finds one:
    ~2.6 GiB/s on one contended core here, 6x torch's elementwise ops)."""
    if encoding == "fp32":
        return int((~torch.isfinite(chunk)).sum())
    magnitude = chunk.view(torch.uint8).numpy()
    if encoding == "e4m3":  # E4M3FN has no infinity; NaN is S.1111.111
        magnitude = magnitude & 0x7F
    nan = 0x7F if encoding == "e4m3" else 0xFF  # 0xFF is E8M0's NaN
    if magnitude.size == 0 or int(magnitude.max()) < nan:
        return 0
    return int(np.count_nonzero(magnitude == nan))


def nonfinite_block_scales(reader: CheckpointReader) -> list[Finding]:
    """Every block scale read with positional reads (no mmap), ``CHUNK_BYTES`` of whole rows at a time into one
    reused buffer (bounded memory, whatever the tensor): those that are NaN/Inf."""
    out = []
    buf = torch.empty(0, dtype=torch.uint8)
    for key, encoding in sorted(_block_scale_keys(reader)):
        info = reader.info(key)
        rows = info.shape[0]
        row_bytes = info.nbytes // rows if rows else 0
        if not row_bytes:
            continue
        step = max(CHUNK_BYTES // row_bytes, 1)
        if buf.numel() < step * row_bytes:
            buf = torch.empty(min(step, rows) * row_bytes, dtype=torch.uint8)
        bad = 0
        for start in range(0, rows, step):
            chunk = buf[: min(step, rows - start) * row_bytes]
            reader.pread_into(info.file, memoryview(chunk.numpy()), info.offset + start * row_bytes)
            bad += _bad_count(chunk.view(info.dtype), encoding)
        if bad:
            out.append(Finding("block-scale-nonfinite", key,
                               f"{bad} of {math.prod(info.shape)} block scales are NaN/Inf: every engine loads them "
                               "as stored and the weights of those blocks, and every token through them, are NaN"))
    return out


# --------------------------------------------------------------------------------------------- activation scales

# Linears whose input is the output of their decoder layer's RMSNorm (``input_layernorm`` before attention,
# ``post_attention_layernorm`` before the MLP/MoE): |x_i| / rms(x) <= sqrt(hidden_size), so that input's amax can
# never exceed sqrt(hidden_size) * max|norm weight|. (Kimi-K3's routed experts read a latent projection, not the
# norm, and are not listed.)
_NORM_READERS = (
    (re.compile(r"^(?P<layer>.*\.layers\.\d+)\.self_attn\.(q_proj|k_proj|v_proj|q_a_proj|kv_a_proj_with_mqa)$"),
     "input_layernorm"),
    (re.compile(r"^(?P<layer>.*\.layers\.\d+)\.mlp\.(?:experts\.\d+\.|shared_experts?\.)?(gate_proj|up_proj)$"),
     "post_attention_layernorm"),
)
# (element amax a format's per-tensor input scale maps to, name): NVFP4 input_scale = amax / (6 * 448).
_INPUT_RANGE = {torch.uint8: (6.0 * 448.0, "NVFP4"), torch.float8_e4m3fn: (448.0, "FP8")}
# How far above the bound an implied amax must lie to be implausible (calibration's max is at most the bound).
IMPLAUSIBLE_FACTOR = 2.0


def implausible_input_scales(reader: CheckpointReader, norm_weight_offset: float = 0.0) -> list[Finding]:
    """``input_scale``s implying an input amax above what their norm's output can reach, with the numbers.
    ``norm_weight_offset``: what the model's norms add to the stored weight (``ServingSpec.norm_weight_offset``)."""
    headers = reader.headers()
    bounds: dict[str, float] = {}
    out = []
    for key in sorted(headers):
        if not key.endswith(".input_scale"):
            continue
        module = key[: -len(".input_scale")]
        weight = headers.get(f"{module}.weight")
        fmt = _INPUT_RANGE.get(weight.dtype) if weight is not None else None
        norm = next((f"{m['layer']}.{n}.weight" for r, n in _NORM_READERS if (m := r.match(module))), None)
        if fmt is None or norm is None or norm not in headers:
            continue
        if norm not in bounds:
            gamma = reader.pread(norm).float() + norm_weight_offset
            bounds[norm] = math.sqrt(gamma.numel()) * float(gamma.abs().max())
        scale = float(reader.pread(key).float().reshape(-1).max())
        implied = scale * fmt[0]
        if implied > IMPLAUSIBLE_FACTOR * bounds[norm]:
            out.append(Finding("activation-scale-implausible", key, (
                f"{fmt[1]} input_scale {scale:.6g} implies an input amax of {implied:.6g}; its input, the output of "
                f"{norm.rsplit('.', 1)[0]}, cannot exceed sqrt(hidden) x max|weight| = {bounds[norm]:.6g} "
                f"({implied / bounds[norm]:.3g}x above it): activations are quantized that much too coarsely "
                f"(an input_scale written as amax/6 instead of amax/(6*448) is 448x; nvfp4_act_headroom's rule, "
                f"also after awq in its presets, puts it there on purpose: rho x the 1st-percentile block amax)")))
    return out


# ---------------------------------------------------------------------------------------------- export side


def export_side_findings(export_dir: str | Path, reader: CheckpointReader, config: dict,
                         source: str | Path | None = None, *, block_scales: bool = True) -> list[Finding]:
    """Every export-side rule's findings on ``export_dir`` (its ``reader`` open; ``source``: the checkpoint it was
    made from, for the sidecars it had; ``block_scales`` False: their scan, the one costly rule, already ran)."""
    path = Path(export_dir)
    return [*sidecar_findings(path, Path(source) if source is not None else None),
            *mtp_findings(config, set(reader.names())),
            *(nonfinite_block_scales(reader) if block_scales else ())]


def refuse_unservable(staged: str | Path, source: str | Path, publishing: str) -> None:
    """What the exporters run on a staged export before publishing it: ``UnservableExport`` naming each broken
    export-side rule (``publishing``: what would have been published, for the message)."""
    from .reader import read_config

    staged, source = Path(staged), Path(source)
    with CheckpointReader(staged, check_values=False) as reader:
        findings = export_side_findings(staged, reader, read_config(staged), source)
    if not any((source / f).is_file() for f in TOKENIZER_FILES):  # nothing to carry: the user brings their own
        findings = [f for f in findings if f.rule != "tokenizer-missing"]
    if findings:
        lines = "\n  ".join(str(f) for f in findings)
        raise UnservableExport(f"not publishing {publishing}: it breaks the serving rule(s) "
                               f"{', '.join(dict.fromkeys(f.rule for f in findings))}:\n  {lines}")


# ------------------------------------------------------------------------------------------------ the table


def rules_table() -> str:
    """``docs/SERVING_RULES.md``'s table of every rule (tested equal to the doc)."""
    lines = ["| rule | verdict | engines | source (engine, version, file, function) | users saw | test | export side |",
             "|---|---|---|---|---|---|---|"]
    for r in RULES.values():
        lines.append(f"| `{r.name}` | {r.verdict} | {', '.join(r.engines)} | {r.source} | {r.reported} | "
                     f"`{r.test}` | {'yes' if r.export_side else 'no'} |")
    return "\n".join(lines)
