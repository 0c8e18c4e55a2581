"""The engine-free parts of the conformance harness: what it calls landed, never written, a post-load
scale mismatch, and the verdict it derives (``tools/conformance``; the drivers' shared code
``drivers/_common.py`` runs in the engine venvs but needs only torch)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from modelopt_k3.check import DIFFERENT, LOADS, REFUSES
from tools.conformance import matrix
from tools.conformance.run import DRIVER_MODELS, export_fingerprint
from tools.conformance.verdict import observed_verdict

sys.path.insert(0, str(Path(matrix.__file__).parent / "drivers"))
import _common as C  # noqa: E402


class Toy(torch.nn.Module):
    """An 'engine' module: a fused [2 pieces] weight, a scale vector, and a parameter no loader fills."""

    def __init__(self):
        super().__init__()
        self.fused = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16), requires_grad=False)
        self.weight_scale_2 = torch.nn.Parameter(torch.ones(2), requires_grad=False)
        self.orphan = torch.nn.Parameter(torch.full((5,), 7.0), requires_grad=False)


def _ours() -> dict[str, torch.Tensor]:
    return {"m.a.weight": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
            "m.b.weight": -torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
            "m.a.weight_scale_2": torch.tensor(0.5), "m.b.weight_scale_2": torch.tensor(0.5)}


def _loader(model: Toy, ours: dict[str, torch.Tensor], *, skip_b: bool = False):
    def load():
        with torch.no_grad():
            model.fused[:2] = ours["m.a.weight"]
            if not skip_b:
                model.fused[2:] = ours["m.b.weight"]
            model.weight_scale_2[0] = ours["m.a.weight_scale_2"]
            model.weight_scale_2[1] = ours["m.b.weight_scale_2"]
    return load


def test_every_tensor_landed_and_the_unfilled_parameter_is_found_and_restored():
    model, ours = Toy(), _ours()
    masks, land = C.load_with_sentinel(model, _loader(model, ours), ours)
    summary = C.summarize(ours, land, masks)
    assert summary["not_landed"] == [] and summary["landed_byte_equal"] == 4
    assert land["m.b.weight"] == {"param": "fused", "offset": 6, "matches": 1}
    assert summary["params_never_written"] == {"orphan": {"elements": 5, "of": 5}}
    assert torch.equal(model.orphan, torch.full((5,), 7.0))  # its initial value, not a sentinel


def test_a_tensor_the_loader_skips_is_not_landed_and_its_rows_are_never_written():
    model, ours = Toy(), _ours()
    masks, land = C.load_with_sentinel(model, _loader(model, ours, skip_b=True), ours)
    summary = C.summarize(ours, land, masks)
    assert summary["not_landed"] == ["m.b.weight"]
    assert summary["params_never_written"]["fused"] == {"elements": 6, "of": 12}


def test_a_one_byte_tensor_holding_the_sentinel_value_is_written_when_an_export_tensor_landed_there():
    class Packed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.codes = torch.nn.Parameter(torch.zeros(2, 4, dtype=torch.uint8), requires_grad=False)

    ours = {"p.weight": torch.tensor([[C.SENTINEL, 1, 2, C.SENTINEL]], dtype=torch.uint8)}
    model = Packed()

    def load():
        with torch.no_grad():
            model.codes[0] = ours["p.weight"][0]

    masks, land = C.load_with_sentinel(model, load, ours)
    assert land["p.weight"]["param"] == "codes"
    assert masks["codes"].tolist() == [False] * 4 + [True] * 4  # row 1 never written, row 0 all landed


def test_values_found_in_another_form():
    engine = {"l.A_log": torch.tensor([1.5, 2.5]), "l.o_norm.weight": torch.tensor([1.0234], dtype=torch.bfloat16),
              "l.f.weight": torch.tensor([0.5], dtype=torch.float32)}
    ours = {"l.A_log": torch.tensor([1.5, 2.5, 0.0, 0.0]), "l.o_norm.weight": torch.tensor([1.0208]),
            "l.f.weight": torch.tensor([0.5], dtype=torch.bfloat16)}
    land = C.landings(ours, engine)
    assert land["l.A_log"]["prefix"] == 2
    assert land["l.o_norm.weight"]["rounded_to"] == "torch.bfloat16" and land["l.o_norm.weight"]["max_rel"] > 1e-3
    assert land["l.f.weight"]["cast_to"] == "torch.float32"
    summary = C.summarize(ours, land, {})
    assert summary["landed_byte_equal"] == 0 and not summary["not_landed"]


def test_post_load_scales_against_the_exports():
    ours = {**_ours(), "m.a.input_scale": torch.tensor(0.25), "m.b.input_scale": torch.tensor(0.25)}
    pieces = {"m.fused": {"lin": [["m.a"], ["m.b"]]}}.get
    good = {"m.fused": {"weight_global_scale": torch.tensor(0.5), "alpha": torch.tensor(0.125),
                        "input_global_scale_inv": torch.tensor(4.0)}}
    report = C.compare_scales(good, ours, pieces)
    assert report["compared"] == 6 and report["mismatch_count"] == 0
    ours["m.b.weight_scale_2"] = torch.tensor(1.0)  # the engine's one fused scale no longer fits b
    report = C.compare_scales(good, ours, pieces)
    bad = {(m["param"], m["index"]) for m in report["mismatches"]}
    assert bad == {("m.fused.weight_global_scale", 1), ("m.fused.alpha", 1)}
    assert report["max_rel"] == pytest.approx(0.5)


def test_routed_expert_scales_per_expert_and_half():
    ours = {}
    for e in range(2):
        for p, w in (("w1", 0.5), ("w3", 0.5 if e == 0 else 0.25), ("w2", 2.0)):
            ours[f"x.{e}.{p}.weight_scale_2"] = torch.tensor(w)
            ours[f"x.{e}.{p}.input_scale"] = torch.tensor(0.1)
    pieces = {"x": {p: [[f"x.{e}.{p}"] for e in range(2)] for p in ("w1", "w3", "w2")}}.get
    engine = {"x": {"w13_weight_scale_2": torch.tensor([0.5, 0.5]), "g2_alphas": torch.tensor([0.2, 0.2]),
                    "w13_input_scale_quant": torch.tensor(10.0)}}
    report = C.compare_scales(engine, ours, pieces)
    assert [(m["param"], m["index"], m["half"]) for m in report["mismatches"]] == [("x.w13_weight_scale_2", 1, "w3")]
    assert report["compared"] == 4 + 2 + 4


def test_tensors_the_engine_skips_or_transforms_on_purpose_are_listed_apart_from_not_landed():
    """``summarize(by_design=...)``: an MTP block the main model skips by name and an ``A_log`` the engine holds as
    ``A = -exp(A_log.float())`` are not "not landed" (so not "serves different numbers"); ``transformed_into``
    names the transform only where the parameter holds exactly its result, and a by-design name that did land is
    not listed."""

    class Mamba(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.A = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
            self.w = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16), requires_grad=False)

    ours = {"m.A_log": torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.bfloat16),
            "m.w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
            "mtp.x": torch.ones(3, dtype=torch.bfloat16)}
    model = Mamba()

    def load():
        with torch.no_grad():
            model.A.copy_(-torch.exp(ours["m.A_log"].float()))
            model.w.copy_(ours["m.w"])

    masks, land = C.load_with_sentinel(model, load, ours)
    params = dict(model.named_parameters())
    minus_exp = lambda t: -torch.exp(t.float())  # noqa: E731
    found = {**C.skipped_by_prefix(ours, ("mtp.",), "the drafter's"),
             **C.transformed_into(ours, params, "m.A_log", "A", minus_exp, "A = -exp(A_log)"),
             "m.w": "listed, but it landed"}
    summary = C.summarize(ours, land, masks, by_design=found)
    assert summary["not_landed"] == []
    assert summary["not_landed_by_design"] == {"m.A_log": "A = -exp(A_log)", "mtp.x": "the drafter's"}
    assert summary["landed_byte_equal"] == 1
    assert observed_verdict({"outcome": "ran", "load": summary, "post_load": {"mismatches": []}}) == LOADS
    with torch.no_grad():  # one element off: no transform found, A_log stays not landed
        model.A[2] += 1
    assert C.transformed_into(ours, dict(model.named_parameters()), "m.A_log", "A", minus_exp, "x") == {}
    assert C.summarize(ours, land, masks)["not_landed"] == ["m.A_log", "mtp.x"]


def test_observed_verdicts():
    ran = {"outcome": "ran", "load": {"not_landed": [], "params_never_written": {}}, "post_load": {"mismatches": []}}
    assert observed_verdict(ran) == LOADS
    assert observed_verdict({**ran, "load": {"not_landed": ["k"], "params_never_written": {}}}) == DIFFERENT
    assert observed_verdict({**ran, "post_load": {"mismatches": [{"rel": 0.5}]}}) == DIFFERENT
    assert observed_verdict({"outcome": "raised", "error": {"stage": "load_weights"}}) == REFUSES
    assert observed_verdict({"outcome": "raised", "error": {"stage": "import"}}) is None
    cuda_op = {"stage": "post_process", "type": "NotImplementedError",
               "message": "Could not run '_C::static_scaled_fp8_quant' with arguments from the 'CPU' backend"}
    assert observed_verdict({"outcome": "raised", "error": cuda_op}) is None  # the CPU's answer, not the engine's
    assert observed_verdict({"outcome": "driver timed out"}) is None


def test_broken_copies_leave_their_source_unchanged(tmp_path: Path, tiny_ckpt: Path):
    from modelopt_k3 import convert_checkpoint

    src = convert_checkpoint(tiny_ckpt, tmp_path / "src", matrix.CONVERTER_DEFAULT, progress=False).dst
    before = export_fingerprint(src)
    out = matrix.EDITS["w3_scale"](src, tmp_path / "w3")
    key = f"{matrix.LM}.layers.1.block_sparse_moe.experts.2.w3.weight_scale_2"
    assert float(matrix._read(out, key)) == 2 * float(matrix._read(src, key))
    assert export_fingerprint(src) == before


def test_each_export_gets_the_driver_of_its_model(tmp_path):
    """``run.driver_of``: the Qwen3-MoE cells run ``drivers/<engine>_qwen3.py``, the Kimi-K3 ones ``<engine>_k3.py``,
    the GPT-OSS and DeepSeek-V3 ones ``<engine>_gpt_oss.py`` / ``<engine>_deepseek_v3.py``."""
    import json

    from tools.conformance.run import DRIVERS, driver_of
    from tools.conformance.venv import EngineSpec

    for model_type, suffix in (("kimi_k3", "k3"), ("qwen3_moe", "qwen3"), ("gpt_oss", "gpt_oss"),
                               ("deepseek_v3", "deepseek_v3"), ("kimi_k25", "kimi_k25"),
                               ("qwen3_5_moe", "qwen3_5_moe"), ("nemotron_h", "nemotron_h"),
                               ("minimax_m2", "minimax_m2"), ("glm_moe_dsa", "deepseek_v3")):
        export = tmp_path / model_type
        export.mkdir()
        (export / "config.json").write_text(json.dumps({"model_type": model_type}))
        for engine in ("vllm", "sglang"):
            driver = driver_of(EngineSpec(engine, "0"), export)
            assert driver == DRIVERS / f"{engine}_{suffix}.py" and driver.is_file()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="no conformance driver for model_type 'llama'"):
        driver_of(EngineSpec("vllm", "0"), tmp_path / "other")


def test_every_tiny_variant_is_a_known_model_and_the_qformat_cells_name_the_recipe_hf_ptq_resolves():
    from modelopt_k3.run.plan import PtqConfig
    from modelopt_k3.spec.registry import get_spec, known_model_types

    assert set(matrix.TINY_MODELS) == set(matrix.TINY_VARIANTS)
    # Every registered model type has cells, and drivers for its exports (a new model cannot be left out).
    assert set(matrix.TINY_MODELS.values()) == set(known_model_types()) == set(DRIVER_MODELS)
    qformat_cells = [c for c in (*matrix.CELLS, *matrix.PENDING_CELLS) if c.qformat]
    assert {c.tiny for c in qformat_cells} == {"qwen3", "qwen3-wide", "gpt_oss", "deepseek_v3", "kimi_k25", "minimax_m2",
                                               "glm_moe_dsa", "qwen3_5_moe", "nemotron_h", "nemotron_h-wide",
                                               "nemotron_h-wide-g2"}
    assert not matrix.PENDING_CELLS  # every model's cells have engine rows (issue 40)
    for cell in qformat_cells:
        assert cell.how == "hf_ptq"
        spec = get_spec(matrix.TINY_MODELS[cell.tiny])
        assert PtqConfig(qformat=cell.qformat).recipe_name(spec) == cell.recipe, cell.id


def test_an_expert_tensor_read_into_a_zero_padded_wider_parameter_is_landed_losslessly():
    """SGLang's flashinfer_trtllm experts pad the intermediate size to 64: a down_proj [r, c] lands as r rows of
    ``w2_weight`` [E, r, c_pad] (first c columns byte for byte, the padding zero) -- no deviation."""

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w2_weight = torch.nn.Parameter(torch.zeros(2, 3, 8, dtype=torch.uint8), requires_grad=False)

    ours = {f"e.{i}.down_proj.weight": torch.randint(1, 255, (3, 5), dtype=torch.uint8) for i in range(2)}
    model = Experts()

    def load():
        with torch.no_grad():
            model.w2_weight.zero_()
            for i in range(2):
                model.w2_weight[i, :, :5] = ours[f"e.{i}.down_proj.weight"]

    masks, land = C.load_with_sentinel(model, load, ours)
    summary = C.summarize(ours, land, masks)
    assert land["e.1.down_proj.weight"]["padded_to"] == 8 and land["e.1.down_proj.weight"]["offset"] == 24
    assert summary["not_landed"] == [] and summary["params_never_written"] == {}
    assert summary["landed_lossless_other_form"] == sorted(ours)
    with torch.no_grad():  # non-zero padding is no lossless landing
        model.w2_weight[1, 0, 7] = 3
    assert C.landings(ours, dict(model.named_parameters()))["e.1.down_proj.weight"] is None


def test_kv_scales_are_compared_on_every_attention_module_of_their_layer():
    """``_common.compare_kv_scales`` (the DeepSeek-V3 drivers' KV check): each module under a layer that holds a KV
    attribute (a one-element tensor or a float) is compared with that layer's export scale -- a second attention
    module left at 1.0 (SGLang's attn_mha) is a mismatch, one matching is not; ``merge_post`` adds the counts."""

    class Attn(torch.nn.Module):
        def __init__(self, k: float, v: float):
            super().__init__()
            self.register_buffer("_k_scale", torch.tensor(k))
            self.v_scale_float = v

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mqa, self.mha = Attn(0.25, 0.5), Attn(1.0, 1.0)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Layer()])
    ours = {"layers.0.self_attn.k_proj.k_scale": torch.tensor(0.25), "layers.0.self_attn.v_proj.v_scale": torch.tensor(0.5)}
    got = C.compare_kv_scales(model, ours, {"_k_scale": "k", "v_scale_float": "v"})
    assert got["compared"] == 4 and got["max_rel"] == pytest.approx(3.0)
    assert sorted(m["param"] for m in got["mismatches"]) == ["layers.0.mha._k_scale", "layers.0.mha.v_scale_float"]
    post = C.merge_post({"compared": 2, "max_rel": 0.0, "mismatches": [], "mismatch_count": 0}, got)
    assert post["compared"] == 6 and post["mismatch_count"] == 2 and observed_verdict(
        {"outcome": "ran", "load": {"not_landed": [], "params_never_written": {}}, "post_load": post}) == DIFFERENT
