"""The serving failures users report (issue 41), each planted into real exports of every model it applies to.

Four exports are made here, once per module: the 128-wide Qwen3-MoE stand-in calibrated NVFP4 (every engine loads
it) and the same with the per-tensor FP8 preset, the Kimi-K3 converter's experts-only NVFP4 export of the 128-wide
stand-in, and DeepSeek-V3 with one MTP layer calibrated NVFP4. Each test copies one, plants one failure and asserts
the verdict the engine really gives under the rule's name (``checkpoint.serving_rules.RULES``); the unplanted
exports load correctly on every engine, so a verdict can only come from the planting. The exporters' own refusal
to publish (the export-side rules) closes the file.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from engine_emulation import edit_export
from safetensors import safe_open

from modelopt_k3 import convert_checkpoint
from modelopt_k3.check import check_export
from modelopt_k3.check.report import CANNOT_START, DIFFERENT, GARBAGE, LOADS, NO_DRAFTER, REFUSES
from modelopt_k3.checkpoint import CheckpointReader
from modelopt_k3.checkpoint import serving_rules as sr
from modelopt_k3.quant.schemes import NVFP4_TENSOR

pytestmark = pytest.mark.slow  # four small exports, then engine checks of edited copies

ENGINES = ("vllm", "sglang", "trtllm")
INDEX = "model.safetensors.index.json"
QWEN_EXPERTS = "model.layers.0.mlp.experts"
K3_EXPERTS = "language_model.model.layers.1.block_sparse_moe.experts"
MTP = "model.layers.3"


# ------------------------------------------------------------------------------------------------ the exports


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    from modelopt_k3.testing import make_tiny_kimi_k3
    from modelopt_k3.testing.deepseek_v3 import make_tiny_deepseek_v3
    from modelopt_k3.testing.qwen3_moe import make_tiny_qwen3_moe
    from modelopt_k3.testing.tiny_gpt_oss import make_tiny_gpt_oss
    from tools.conformance.matrix import QWEN3_WIDE_SIZES, WIDE_SIZES

    root = tmp_path_factory.mktemp("serving_rules_sources")
    return {
        "qwen3_moe": make_tiny_qwen3_moe(root / "qwen3", seed=0, **QWEN3_WIDE_SIZES, moe_intermediate_size=128),
        "kimi_k3": make_tiny_kimi_k3(root / "k3", seed=0, **WIDE_SIZES),
        "deepseek_v3": make_tiny_deepseek_v3(root / "ds", source="bf16", num_nextn_predict_layers=1),
        "gpt_oss": make_tiny_gpt_oss(root / "gpt_oss", seed=0),
    }


@pytest.fixture(scope="module")
def exports(sources, tmp_path_factory) -> dict[str, Path]:
    from models.deepseek_v3.conftest import quantize_and_export as deepseek_export
    from models.qwen3_moe.conftest import quantize_and_export as qwen3_export

    root = tmp_path_factory.mktemp("serving_rules_exports")
    return {
        "qwen3_moe": qwen3_export(sources["qwen3_moe"], root / "qwen3"),
        "qwen3_moe_fp8": qwen3_export(sources["qwen3_moe"], root / "qwen3_fp8", recipe="presets/fp8"),
        "kimi_k3": convert_checkpoint(sources["kimi_k3"], root / "k3", "models/moonshotai/Kimi-K3/nvfp4_experts",
                                      progress=False).dst,
        "deepseek_v3": deepseek_export(sources["deepseek_v3"], root / "ds"),
        # No engine serves GPT-OSS's per-expert NVFP4 export (README, GPT-OSS): these rules' findings still join
        # every engine's verdict, below the engines' own refusals.
        "gpt_oss": convert_checkpoint(sources["gpt_oss"], root / "gpt_oss", "models/openai/gpt-oss/nvfp4_experts",
                                      progress=False).dst,
    }


NVFP4_EXPORTS = ("qwen3_moe", "kimi_k3", "deepseek_v3")  # every engine loads these unplanted
ALL_MODELS = (*NVFP4_EXPORTS, "gpt_oss")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _tensor(export: Path, key: str) -> torch.Tensor:
    fname = json.loads((export / INDEX).read_text())["weight_map"][key]
    with safe_open(str(export / fname), framework="pt") as f:
        return f.get_tensor(key)


def _keys(export: Path, pattern: str) -> list[str]:
    return sorted(k for k in json.loads((export / INDEX).read_text())["weight_map"] if re.fullmatch(pattern, k))


def _check(export: Path, **kwargs):
    return check_export(export, ENGINES, **kwargs)


def _verdicts(report) -> dict[str, str]:
    return {e: r.verdict for e, r in report.results.items()}


def _rules(result) -> set[str]:
    return {r.rule for r in result.refusals} | {d.rule for d in result.deviations}


def test_the_unplanted_exports_load_on_every_engine_without_findings_of_these_rules(exports):
    for name, export in exports.items():
        report = _check(export)
        if name != "gpt_oss":
            assert _verdicts(report) == dict.fromkeys(ENGINES, LOADS), (name, report.table())
        for result in report.results.values():
            assert not _rules(result) - {""}, (name, result.details())
            assert not any(f"[{rule}]" in w for w in result.warnings for rule in sr.RULES), (name, result.warnings)


# ------------------------------------------------------------------------------------------- sidecar files


@pytest.mark.parametrize("model", ALL_MODELS)
def test_tokenizer_missing(exports, model, tmp_path):
    export = _copy(exports[model], tmp_path / "export")
    for name in sr.TOKENIZER_FILES:
        (export / name).unlink(missing_ok=True)
    report = _check(export)
    assert _verdicts(report) == dict.fromkeys(ENGINES, CANNOT_START), report.table()
    for result in report.results.values():
        (refusal,) = [r for r in result.refusals if r.verdict == CANNOT_START]
        assert refusal.rule == "tokenizer-missing" and "server does not start" in refusal.reason
        assert result.headline().startswith("first failing: [tokenizer-missing] ")  # the most severe first


@pytest.mark.parametrize("model", NVFP4_EXPORTS)
def test_sidecar_dropped(exports, sources, model, tmp_path):
    """A generation config the source had, and a chat template in its tokenizer_config.json: silently different
    generations. The check compares with the source it is given (or a converter's marker names)."""
    export = _copy(exports[model], tmp_path / "export")
    (export / "generation_config.json").unlink()
    report = _check(export, source=sources[model])
    assert _verdicts(report) == dict.fromkeys(ENGINES, DIFFERENT), report.table()
    for result in report.results.values():
        (dev,) = result.deviations
        assert dev.rule == "sidecar-dropped" and dev.module == "generation_config.json" and "generation config" in dev.what
    # Without a source, what it had is unknown -- except for a converter's export, whose marker names it.
    unknown = DIFFERENT if model == "kimi_k3" else LOADS
    assert _verdicts(_check(export)) == dict.fromkeys(ENGINES, unknown)

    source = _copy(sources[model], tmp_path / "source")
    config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ messages }}"}))
    report = _check(exports[model], source=source)
    assert _verdicts(report) == dict.fromkeys(ENGINES, DIFFERENT), report.table()
    assert [d.module for d in report.results["vllm"].deviations] == ["tokenizer_config.json"]


# ------------------------------------------------------------------------------------------------- MTP layers


def test_mtp_layers_missing(exports, tmp_path):
    """Deleted while config.json still declares num_nextn_predict_layers = 1: the main model loads, the drafter
    finds nothing (vLLM #35548). Before, the check said "loads correctly" and even the MTP warning went away."""
    export = edit_export(exports["deepseek_v3"], tmp_path / "export", drop=set(_keys(exports["deepseek_v3"],
                                                                                      rf"{MTP}\..*")))
    report = _check(export)
    assert _verdicts(report) == dict.fromkeys(ENGINES, NO_DRAFTER), report.table()
    for result in report.results.values():
        (refusal,) = result.refusals
        assert refusal.rule == "mtp-layers-missing" and refusal.tensor == MTP, refusal
        assert "num_nextn_predict_layers = 1" in refusal.reason and "holds no tensor" in refusal.reason


def test_mtp_quantized_but_excluded(exports, tmp_path):
    """An MTP Linear stored NVFP4 while the configs still exclude the MTP layer (``model.layers.3*``): the drafter,
    built with the same quant config, does not load (ModelOpt #2427, vLLM #44087); the main model does."""
    name = f"{MTP}.self_attn.o_proj"
    weight = _tensor(exports["deepseek_v3"], f"{name}.weight").float()
    planted = NVFP4_TENSOR.weight_tensors(weight, weight.abs().amax() / (6 * 448))
    planted = {f"{name}.{k}": v for k, v in planted.items()} | {f"{name}.input_scale": torch.tensor(0.01)}
    export = edit_export(exports["deepseek_v3"], tmp_path / "export", add=planted)
    hf = json.loads((export / "hf_quant_config.json").read_text())["quantization"]
    assert any(MTP in e for e in hf["exclude_modules"]), hf["exclude_modules"]  # still excluded
    report = _check(export)
    assert _verdicts(report)["vllm"] == _verdicts(report)["sglang"] == NO_DRAFTER, report.table()
    for engine in ("vllm", "sglang"):
        (refusal,) = report.results[engine].refusals
        assert refusal.rule == "mtp-drafter-format" and refusal.tensor == f"{name}.weight", refusal
        assert refusal.reason.startswith("MTP drafter: stored nvfp4, but") and "exclude" in refusal.reason


# ----------------------------------------------------------------------------------------------- block scales


def _nan_block(export: Path, key: str, dst: Path, *, index: int = 5) -> Path:
    scale = _tensor(export, key).clone()
    scale.view(torch.uint8).reshape(-1)[index] = 0x7F  # E4M3FN NaN
    return edit_export(export, dst, add={key: scale})


@pytest.mark.parametrize("model", ALL_MODELS)
def test_block_scale_nan(exports, model, tmp_path):
    """One E4M3 block scale of one expert NaN: every engine copies it as stored; tokens routed there give NaN.
    (GPT-OSS: vLLM and TensorRT-LLM refuse the export anyway, which stays their verdict; SGLang's is garbage.)"""
    experts = {"qwen3_moe": QWEN_EXPERTS, "kimi_k3": K3_EXPERTS, "deepseek_v3": "model.layers.1.mlp.experts",
               "gpt_oss": "model.layers.0.mlp.experts"}[model]
    proj = {"kimi_k3": "w1", "gpt_oss": "gate_up_proj"}.get(model, "gate_proj")
    key = f"{experts}.1.{proj}.weight_scale"
    report = _check(_nan_block(exports[model], key, tmp_path / "export"))
    expected = dict.fromkeys(ENGINES, GARBAGE) if model != "gpt_oss" else {"vllm": REFUSES, "sglang": GARBAGE,
                                                                           "trtllm": REFUSES}
    assert _verdicts(report) == expected, report.table()
    for result in report.results.values():
        (refusal,) = [r for r in result.refusals if r.rule == "block-scale-nonfinite"]
        assert refusal.tensor == key and refusal.verdict == GARBAGE
        assert refusal.reason.startswith("1 of ") and "NaN" in refusal.reason


def test_block_scales_are_read_in_bounded_chunks(exports, tmp_path, monkeypatch):
    """Every byte of every block scale is read, by positional reads of whole rows, ``CHUNK_BYTES`` at a time: a NaN
    in the last row of the largest scale tensor is found with chunks of one row (the memory bound)."""
    export = exports["qwen3_moe"]
    with CheckpointReader(export) as reader:
        keys = [k for k, _ in sr._block_scale_keys(reader)]
        key = max(keys, key=lambda k: reader.info(k).nbytes)
        info = reader.info(key)
        total = sum(reader.info(k).nbytes for k in keys)
        widest = max(reader.info(k).nbytes // reader.info(k).shape[0] for k in keys)
    planted = _nan_block(export, key, tmp_path / "export", index=info.nbytes - 1)
    row = info.nbytes // info.shape[0]
    monkeypatch.setattr(sr, "CHUNK_BYTES", row)
    reads: list[int] = []
    original = CheckpointReader.pread_into

    def logged(self, file, view, offset):
        reads.append(len(view))
        return original(self, file, view, offset)

    monkeypatch.setattr(CheckpointReader, "pread_into", logged)
    with CheckpointReader(planted) as reader:
        found = sr.nonfinite_block_scales(reader)
    assert [(f.rule, f.where) for f in found] == [("block-scale-nonfinite", key)]
    assert sum(reads) == total and max(reads) <= max(row, widest)  # each byte once, never more than a chunk


# ------------------------------------------------------------------------------------------- activation scales


@pytest.mark.parametrize("model", ("qwen3_moe", "deepseek_v3"))
def test_input_scale_x448_warns(exports, model, tmp_path):
    """Every input_scale written as amax/6 (x448, a withdrawn community export): all engines load it and quantize
    activations 448x too coarsely; the check warns with the numbers on every engine (verdict unchanged)."""
    keys = _keys(exports[model], r".*\.input_scale")
    export = edit_export(exports[model], tmp_path / "export", add={k: _tensor(exports[model], k) * 448 for k in keys})
    report = _check(export)
    assert _verdicts(report) == dict.fromkeys(ENGINES, LOADS), report.table()
    # A reader of input_layernorm (Qwen3-MoE's q_proj), of post_attention_layernorm (DeepSeek-V3's dense gate_proj;
    # its MLA q_a/kv_a stay BF16 in the recipe).
    reader = "model.layers.0.self_attn.q_proj" if model == "qwen3_moe" else "model.layers.0.mlp.gate_proj"
    for result in report.results.values():
        warned = [w for w in result.warnings if w.startswith("[activation-scale-implausible]")]
        assert any(f"{reader}.input_scale" in w for w in warned), result.warnings
        text = next(w for w in warned if f"{reader}.input_scale" in w)
        scale = float(_tensor(export, f"{reader}.input_scale"))
        assert f"input_scale {scale:.6g} implies an input amax of {scale * 2688:.6g}" in text, text
        assert "cannot exceed sqrt(hidden) x max|weight|" in text
    # Not at x1: the calibrated scales lie within the bound.
    assert sr.implausible_input_scales(CheckpointReader(exports[model])) == []


# -------------------------------------------------------------------- scales per engine: TensorRT-LLM's fc31


@pytest.mark.parametrize("scale", ("weight_scale_2", "input_scale"))
@pytest.mark.parametrize("model", NVFP4_EXPORTS)
def test_k3_trtllm_w1_w3_scales_differ(exports, model, scale, tmp_path):
    """One expert's w3 scale differs from its w1's: TensorRT-LLM's NVFP4 fused-MoE loader asserts them equal. The
    Kimi-K3 replay said "loads correctly" (it read formats only); Qwen3-MoE's and DeepSeek-V3's refused, now under
    the rule's name. vLLM and SGLang read w3 with w1's scale / take the max: different numbers."""
    experts, (w1, w3) = {"qwen3_moe": (QWEN_EXPERTS, ("gate_proj", "up_proj")),
                         "kimi_k3": (K3_EXPERTS, ("w1", "w3")),
                         "deepseek_v3": ("model.layers.1.mlp.experts", ("gate_proj", "up_proj"))}[model]
    key = f"{experts}.0.{w3}.{scale}"
    export = edit_export(exports[model], tmp_path / "export", add={key: _tensor(exports[model], key) * 1.5})
    report = _check(export)
    trt = report.results["trtllm"]
    assert trt.verdict == REFUSES, report.table()
    (refusal,) = [r for r in trt.refusals if r.rule == "trtllm-fc31-scales"]
    assert refusal.tensor == f"{experts}.0.{w1}.{scale}" and f"{scale} differ across {w1}, {w3}" in refusal.reason
    assert "load_expert_fc31" in refusal.reason
    assert report.results["vllm"].verdict == report.results["sglang"].verdict == DIFFERENT


# --------------------------------------------------------------------- verdicts of the right kind (vLLM/SGLang)


def test_expert_input_scale_missing(exports, tmp_path):
    """A missing expert input_scale, and a whole bank without them under an NVFP4 config (an undeclared W4A16 MoE):
    vLLM loads uninitialised memory and serves garbage silently (vLLM #45212); the check no longer says "refuses"
    for vLLM nor calls it "stored w4a16_nvfp4"."""
    export = exports["qwen3_moe"]
    one = edit_export(export, tmp_path / "one", drop={f"{QWEN_EXPERTS}.3.up_proj.input_scale"})
    bank = edit_export(export, tmp_path / "bank", drop=set(_keys(export, r".*\.experts\.\d+\.\w+\.input_scale")))
    for planted, first in ((one, f"{QWEN_EXPERTS}.3.up_proj.input_scale"),
                           (bank, f"{QWEN_EXPERTS}.0.down_proj.input_scale")):
        report = _check(planted)
        vllm = report.results["vllm"]
        assert vllm.verdict == GARBAGE, report.table()
        assert vllm.refusals[0].tensor == first and vllm.refusals[0].rule == "input-scale-missing"
        assert "torch.empty" in vllm.refusals[0].reason
        sglang = report.results["sglang"]
        assert sglang.verdict == REFUSES and sglang.refusals[0].tensor == first
        assert "w4a16" not in sglang.refusals[0].reason and "expects an input_scale" in sglang.refusals[0].reason


def test_block_scale_stored_uint8(exports, tmp_path):
    """An E4M3 block scale stored as its bytes (uint8): copy_ converts the integers 0..255 by value. vLLM and
    SGLang load it and serve garbage."""
    key = f"{QWEN_EXPERTS}.2.down_proj.weight_scale"
    export = edit_export(exports["qwen3_moe"], tmp_path / "export",
                         add={key: _tensor(exports["qwen3_moe"], key).view(torch.uint8)})
    report = _check(export)
    for engine in ("vllm", "sglang"):
        result = report.results[engine]
        assert result.verdict == GARBAGE, report.table()
        assert (result.refusals[0].rule, result.refusals[0].tensor) == ("scale-dtype-converted", key)


def test_bf16_weight_scale_2_loads(exports, tmp_path):
    """Over-strict before: a bf16 weight_scale_2 was refused on vLLM/SGLang, though copy_ into their fp32 parameter
    is exact. Every global scale bf16 (gate/up still equal): loads correctly."""
    export = exports["qwen3_moe"]
    keys = _keys(export, r".*\.weight_scale_2")
    planted = edit_export(export, tmp_path / "export", add={k: _tensor(export, k).to(torch.bfloat16) for k in keys})
    report = _check(planted)
    assert report.results["vllm"].verdict == report.results["sglang"].verdict == LOADS, report.table()


def test_fp8_scale_wrong_prefix(exports, tmp_path):
    """An FP8 weight_scale written under another prefix: vLLM's load_weights skips the stray name and serves the
    weight with the scale its FP8 method created (finfo(float32).min): loads, garbage, no error."""
    export = exports["qwen3_moe_fp8"]
    key = "model.layers.0.self_attn.o_proj.weight_scale"
    planted = edit_export(export, tmp_path / "export", drop={key}, add={f"language_model.{key}": _tensor(export, key)})
    report = _check(planted)
    vllm = report.results["vllm"]
    assert vllm.verdict == GARBAGE, report.table()
    assert (vllm.refusals[0].rule, vllm.refusals[0].tensor) == ("fp8-weight-scale-missing", key)


# ------------------------------------------------------------------------------------ what the exporters write


def test_fp8_groups_share_their_scales(exports, sources, tmp_path, monkeypatch):
    """The per-tensor FP8 recipe: q/k/v share one weight_scale and one input_scale (the engines fuse them into
    qkv_proj), so it loads correctly. Unshared (ModelOpt 0.47's choice, and this exporter's before issue 41) the
    engines requantize to the max scale: "serves different numbers", 5.9% on the largest element here."""
    from models.qwen3_moe.conftest import quantize_and_export

    from modelopt_k3.quant import decisions

    export = exports["qwen3_moe_fp8"]
    for layer in range(2):
        attn = f"model.layers.{layer}.self_attn"
        for part in ("weight_scale", "input_scale"):
            values = {float(_tensor(export, f"{attn}.{p}.{part}")) for p in ("q_proj", "k_proj", "v_proj")}
            assert len(values) == 1, (attn, part, values)
    assert _verdicts(check_export(export, ("vllm", "sglang"))) == {"vllm": LOADS, "sglang": LOADS}

    shares = decisions.shares_group_scales
    monkeypatch.setattr(decisions, "shares_group_scales", lambda fmt: shares(fmt) and fmt.weights.name != "fp8")
    unshared = quantize_and_export(sources["qwen3_moe"], tmp_path / "unshared", recipe="presets/fp8")
    report = check_export(unshared, ("vllm", "sglang"))
    assert _verdicts(report) == {"vllm": DIFFERENT, "sglang": DIFFERENT}
    worst = max(report.results["vllm"].deviations, key=lambda d: d.error)
    assert worst.module.endswith(".qkv_proj") and "requantizes to the max" in worst.what
    assert worst.error == pytest.approx(0.0588, abs=5e-4)


def test_sidecars_are_carried(sources, tmp_path):
    """The chat template, a processor config and the generation config the source has: in the export, bytes equal."""
    from models.qwen3_moe.conftest import quantize_and_export

    source = _copy(sources["qwen3_moe"], tmp_path / "source")
    (source / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (source / "preprocessor_config.json").write_text('{"do_resize": false}\n')
    (source / "additional_chat_templates").mkdir()
    (source / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    export = quantize_and_export(source, tmp_path / "export")
    for name in ("chat_template.jinja", "preprocessor_config.json", "generation_config.json", "tokenizer.json",
                 "additional_chat_templates/tool_use.jinja"):
        assert (export / name).read_bytes() == (source / name).read_bytes(), name
    assert sr.sidecar_findings(export, source) == []
    (export / "additional_chat_templates" / "tool_use.jinja").unlink()
    assert [(f.rule, f.where) for f in sr.sidecar_findings(export, source)] == [
        ("sidecar-dropped", "additional_chat_templates/tool_use.jinja")]


def test_the_exporters_refuse_to_publish_an_export_breaking_a_rule(sources, tmp_path, monkeypatch):
    """hf_ptq's export and the converter run the export-side rules on what they staged and refuse, naming the
    rule: nothing is published (the export directory stays absent; the converter writes no completion marker)."""
    from models.qwen3_moe.conftest import quantize_and_export

    from modelopt_k3.convert import COMPLETE_MARKER
    from modelopt_k3.convert import state as convert_state
    from modelopt_k3.export import model_export

    def drops_generation_config(copy):
        def copy_without(src, dst):
            copy(src, dst)
            (dst / "generation_config.json").unlink()
        return copy_without

    monkeypatch.setattr(model_export, "copy_side_files", drops_generation_config(model_export.copy_side_files))
    with pytest.raises(sr.UnservableExport, match=r"not publishing the export: it breaks the serving rule\(s\) "
                                                  r"sidecar-dropped:\n  \[sidecar-dropped\] generation_config.json"):
        quantize_and_export(sources["qwen3_moe"], tmp_path / "export")
    assert not (tmp_path / "export").exists()

    monkeypatch.setattr(convert_state, "copy_side_files", drops_generation_config(convert_state.copy_side_files))
    with pytest.raises(sr.UnservableExport, match=r"sidecar-dropped"):
        convert_checkpoint(sources["kimi_k3"], tmp_path / "k3", "models/moonshotai/Kimi-K3/nvfp4_experts",
                           progress=False)
    assert not (tmp_path / "k3" / COMPLETE_MARKER).exists()


def test_the_check_cli_takes_the_source_and_prints_rule_names(exports, sources, tmp_path, capsys):
    from modelopt_k3.cli import check as check_cli

    export = _copy(exports["qwen3_moe"], tmp_path / "export")
    (export / "generation_config.json").unlink()
    assert check_cli.main([str(export), "--engine", "vllm"]) == 0  # nothing says what the source had
    assert check_cli.main([str(export), "--engine", "vllm", "--source", str(sources["qwen3_moe"])]) == 1
    out = capsys.readouterr().out
    assert "vllm  loads but serves different numbers -- 1 module(s) differ, max relative error n/a (not a tensor's " \
           "numbers) ([sidecar-dropped] generation_config.json: the source has its generation config" in out, out


def test_a_sidecar_directory_planted_as_a_link_is_not_written_through(sources, tmp_path):
    from modelopt_k3.checkpoint import CheckpointError
    from modelopt_k3.export.writer import copy_side_files

    source = _copy(sources["qwen3_moe"], tmp_path / "source")
    (source / "additional_chat_templates").mkdir()
    (source / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    dst, elsewhere = tmp_path / "dst", tmp_path / "elsewhere"
    dst.mkdir()
    elsewhere.mkdir()
    (dst / "additional_chat_templates").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="not a directory of ours"):
        copy_side_files(source, dst)
    assert list(elsewhere.iterdir()) == []


def test_the_table_shows_two_warnings_of_a_rule_and_counts_the_rest() -> None:
    """``nvfp4_act_headroom`` trips the plausibility warning on every Linear: the table keeps two lines of it and
    counts the rest, so the other findings and engines stay on screen."""
    from modelopt_k3.check.report import CheckReport, EngineResult

    warnings = [f"[activation-scale-implausible] layer.{i}.input_scale: too coarse" for i in range(5)]
    warnings.insert(1, "config.json: something else")
    table = CheckReport("x", {"vllm": EngineResult("vllm", warnings=warnings)}).table()
    said = [line.split("warns: ", 1)[1] for line in table.splitlines() if "warns: " in line]
    assert said == [warnings[0], "config.json: something else", warnings[2],
                    "[activation-scale-implausible] ... and 3 more like these"]
