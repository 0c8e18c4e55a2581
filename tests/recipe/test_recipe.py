"""Recipe loader, data model and validation (fast: no torch, no model)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from modelopt_k3.quant.calibrators import CONFIGS, algorithm_config, calibrator_for, qformat_presets
from modelopt_k3.quant.schemes import KV_FP8
from modelopt_k3.recipe import (
    DISABLED,
    FP8_PB_WO,
    NVFP4,
    QuantFormat,
    Recipe,
    RecipeEntry,
    RecipeError,
    available_presets,
    load_recipe,
    parse_overrides,
    recipe_from_dict,
    recipes_roots,
)

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
MIRROR = "models/moonshotai/Kimi-K3/nvfp4_experts-fp8_pb_attention"

# Kimi-K3 quantizable (Linear) module names with their real [out, in] shapes. Layer 0 is KDA
# with the dense MLP, layer 1 KDA + MoE, layer 3 MLA + MoE (full_attn_layers are 1-indexed).
D, P, DK, HK, DL, I_MOE = 7168, 12288, 128, 96, 3584, 3072
LM = "language_model.model"
KDA = {
    "q_proj": (P, D), "k_proj": (P, D), "v_proj": (P, D), "f_a_proj": (DK, D), "f_b_proj": (P, DK),
    "b_proj": (HK, D), "g_proj": (P, D), "o_proj": (D, P),
}
MLA = {
    "q_a_proj": (1536, D), "q_b_proj": (96 * 192, 1536), "kv_a_proj_with_mqa": (512 + 64, D),
    "kv_b_proj": (96 * 256, 512), "o_proj": (D, 96 * 128), "g_proj": (96 * 128, D),
}


def kimi_k3_modules() -> dict[str, tuple[int, int]]:
    mods: dict[str, tuple[int, int]] = {}
    for layer, attn in ((0, KDA), (1, KDA), (3, MLA)):
        for proj, shape in attn.items():
            mods[f"{LM}.layers.{layer}.self_attn.{proj}"] = shape
        mods[f"{LM}.layers.{layer}.self_attention_res_proj"] = (1, D)
        mods[f"{LM}.layers.{layer}.mlp_res_proj"] = (1, D)
    for proj, shape in {"gate_proj": (33792, D), "up_proj": (33792, D), "down_proj": (D, 33792)}.items():
        mods[f"{LM}.layers.0.mlp.{proj}"] = shape
    for layer in (1, 3):
        moe = f"{LM}.layers.{layer}.block_sparse_moe"
        mods[f"{moe}.gate"] = (896, D)  # a bare Parameter upstream; listed in case a port makes it a Linear
        mods[f"{moe}.routed_expert_down_proj"] = (DL, D)
        mods[f"{moe}.routed_expert_up_proj"] = (D, DL)
        for e in (0, 3, 895):
            mods[f"{moe}.experts.{e}.w1"] = (I_MOE, DL)
            mods[f"{moe}.experts.{e}.w3"] = (I_MOE, DL)
            mods[f"{moe}.experts.{e}.w2"] = (DL, I_MOE)
        for proj, shape in {"gate_proj": (6144, D), "up_proj": (6144, D), "down_proj": (D, 6144)}.items():
            mods[f"{moe}.shared_experts.{proj}"] = shape
    mods[f"{LM}.output_attn_res_proj"] = (1, D)
    mods["language_model.lm_head"] = (163840, D)
    for blk in (0, 26):
        mods[f"vision_tower.encoder.blocks.{blk}.wqkv"] = (3 * 1536, 1024)
        mods[f"vision_tower.encoder.blocks.{blk}.wo"] = (1024, 1536)
        mods[f"vision_tower.encoder.blocks.{blk}.mlp.fc0"] = (4096, 1024)
        mods[f"vision_tower.encoder.blocks.{blk}.mlp.fc1"] = (1024, 4096)
    mods["mm_projector.proj.0"] = (4096, 4096)
    mods["mm_projector.proj.2"] = (D, 4096)
    return mods


# Non-Linear modules: never quantizable, but a pattern that resolves them must still say BF16.
OTHER_MODULES = [
    f"{LM}.embed_tokens", f"{LM}.norm", f"{LM}.output_attn_res_norm",
    f"{LM}.layers.1.input_layernorm", f"{LM}.layers.1.post_attention_layernorm",
    f"{LM}.layers.1.self_attention_res_norm", f"{LM}.layers.1.mlp_res_norm",
    f"{LM}.layers.1.self_attn.q_conv1d", f"{LM}.layers.1.self_attn.o_norm",
    f"{LM}.layers.3.self_attn.q_a_layernorm", f"{LM}.layers.3.self_attn.kv_a_layernorm",
    f"{LM}.layers.1.block_sparse_moe.routed_expert_norm", "mm_projector.post_norm",
    "vision_tower.encoder.final_layernorm",
]


def kind(name: str) -> str:
    """The role of a module name, for the expectations tables."""
    always_bf16 = ("block_sparse_moe.gate", "routed_expert_", "_res_proj", "lm_head", "vision_tower",
                   "mm_projector")
    if name.endswith("block_sparse_moe.gate") or any(k in name for k in always_bf16[1:]):
        return "bf16"
    if ".block_sparse_moe.experts." in name:
        return "expert"
    if ".shared_experts." in name:
        return "shared"
    if ".mlp." in name:
        return "dense_mlp"
    if ".self_attn." in name:
        return "attn"
    raise AssertionError(name)


EXPECTED = {
    # Attention stays BF16 for vLLM's and SGLang's Kimi-K3 classes (units/engine_bf16).
    "nvfp4": {"expert": NVFP4, "shared": NVFP4, "dense_mlp": NVFP4, "attn": None, "bf16": None},
    "nvfp4_experts_only": {"expert": NVFP4, "shared": None, "dense_mlp": None, "attn": None, "bf16": None},
    "w4a16_nvfp4": {k: (QuantFormat("nvfp4", None) if k != "bf16" else None)
                    for k in ("expert", "shared", "dense_mlp", "attn", "bf16")},
    "fp8": {k: (QuantFormat("fp8", "fp8") if k != "bf16" else None)
            for k in ("expert", "shared", "dense_mlp", "attn", "bf16")},
    MIRROR: {"expert": QuantFormat("nvfp4", "nvfp4", 2688.0), "shared": None, "dense_mlp": None,
             "attn": FP8_PB_WO, "bf16": None},
}


def write(tmp_path: Path, rel: str, text: str) -> Path:
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# --------------------------------------------------------------------------- shipped recipes


def test_every_shipped_recipe_loads():
    files = sorted(RECIPES.rglob("*.yaml"))
    assert len(files) >= 6
    for f in files:
        recipe = load_recipe(f)
        assert recipe.entries
        # An algorithm's preset says so in its name (the registry's presets); every other recipe calibrates by max.
        preset = next((name for name, _ in qformat_presets().values() if f.stem.endswith(f"_{name}")), None)
        assert (recipe.algorithm != "max") == (preset is not None), f
        algorithm_config(recipe.algorithm)  # the registry takes its options
    assert set(available_presets()) >= {"nvfp4", "nvfp4_experts_only", "w4a16_nvfp4", "fp8"}


def test_an_unknown_algorithm_is_refused_by_the_registry(tmp_path):
    """A recipe holds the method as written; the registry refuses it, naming the registered ones, before a
    quantizer is attached (quantize asks it first) or a weight is read (the preflight's plan asks it)."""
    path = write(tmp_path, "awq.yaml", """\
        algorithm: awq_lite
        quant_cfg: [{pattern: "*", weights: nvfp4, inputs: nvfp4}]
        """)
    recipe = load_recipe(path)
    expected = r"algorithm 'awq_lite' is not supported; expected one of \[" + ", ".join(repr(m) for m in CONFIGS) + r"\]"
    with pytest.raises(ValueError, match=expected):
        calibrator_for(recipe.algorithm)
    assert {"max", "mse", "local_hessian", "gptq"} <= set(CONFIGS)


def test_name_lookup():
    assert load_recipe("nvfp4").path == RECIPES / "presets" / "nvfp4.yaml"
    assert load_recipe("presets/nvfp4.yaml").path == RECIPES / "presets" / "nvfp4.yaml"
    mirror = load_recipe(MIRROR)
    assert mirror.name == MIRROR and mirror.kv_cache is None
    with pytest.raises(RecipeError, match=r"not found.*Available presets: .*nvfp4_experts_only"):
        load_recipe("no_such_recipe")


def test_env_search_dir(tmp_path, monkeypatch):
    write(tmp_path, "presets/mine.yaml", """\
        quant_cfg:
          - pattern: "*.experts*"
            weights: fp8
            inputs: fp8
          - import: units/default_disabled
        """)
    monkeypatch.setenv("MODELOPT_K3_RECIPES", str(tmp_path))
    assert recipes_roots()[0] == tmp_path.resolve()
    recipe = load_recipe("mine")
    assert recipe.path == tmp_path.resolve() / "presets" / "mine.yaml"
    assert "mine" in available_presets()


@pytest.mark.parametrize("recipe_name", list(EXPECTED))
def test_resolution_on_kimi_k3_names(recipe_name):
    recipe = load_recipe(recipe_name)
    modules = kimi_k3_modules()
    for name in modules:
        fmt, _ = recipe.resolve(name)
        assert fmt == EXPECTED[recipe_name][kind(name)], (recipe_name, name, fmt)
    for name in OTHER_MODULES:
        assert recipe.resolve(name)[0] is None, (recipe_name, name)
    recipe.check_against(modules)  # must_match patterns hit, NVFP4 layers are 16-divisible


def test_disabled_reasons_and_summary():
    recipe = load_recipe("nvfp4")
    fmt, entry = recipe.resolve(f"{LM}.layers.1.block_sparse_moe.gate")
    assert fmt is None and entry.reason == "router"
    assert "default_disabled.yaml: quant_cfg[0]" in entry.source and "nvfp4.yaml: quant_cfg[1]" in entry.source
    assert recipe.resolve(f"{LM}.layers.1.block_sparse_moe.routed_expert_up_proj")[1].reason == (
        "latent-expert projection")
    assert recipe.resolve("language_model.lm_head")[1].reason == "lm_head"
    text = recipe.summary(kimi_k3_modules())
    assert "(router)" in text and "NVFP4" in text


def test_mirror_needs_no_calibration():
    modules = kimi_k3_modules()
    assert not load_recipe(MIRROR).needs_calibration(modules)
    assert load_recipe("nvfp4").needs_calibration(modules)
    assert not load_recipe("w4a16_nvfp4").needs_calibration(modules)
    assert load_recipe(MIRROR, overrides={"kv_cache": "fp8"}).needs_calibration(modules)


def test_algo_names():
    assert NVFP4.algo == "NVFP4" and NVFP4.group_size == 16
    assert QuantFormat("nvfp4", None).algo == "W4A16_NVFP4"
    assert QuantFormat("fp8", "fp8").algo == "FP8"
    assert FP8_PB_WO.algo == "FP8_PB_WO"
    assert not DISABLED.enabled
    for weights, inputs in (("fp8", None), ("fp8_pb", "fp8"), ("nvfp4", "fp8"), ("fp8", "nvfp4")):
        with pytest.raises(ValueError, match="no ModelOpt quant_algo"):
            QuantFormat(weights, inputs)


# --------------------------------------------------------------------------- semantics


def test_later_entries_win_and_import_positions(tmp_path):
    write(tmp_path, "units/experts_fp8.yaml", """\
        quant_cfg:
          - pattern: "*.experts.*"
            weights: fp8
            inputs: fp8
        """)
    path = write(tmp_path, "r.yaml", """\
        imports: [./units/experts_fp8]      # before quant_cfg[0]: overridden by "*"
        quant_cfg:
          - pattern: "*"
            weights: nvfp4
            inputs: nvfp4
          - pattern: "*.w2"
            weights: nvfp4
            inputs: null
          - import: ./units/experts_fp8      # here: overrides both entries above
          - pattern: "*.experts.0.*"
            enable: false
            reason: test
        """)
    recipe = load_recipe(path)
    # The first import's copy of "*.experts.*" is followed by an identical one, so it never decides: dropped.
    assert [e.pattern for e in recipe.entries] == ["*", "*.w2", "*.experts.*", "*.experts.0.*"]
    assert recipe.resolve("m.experts.1.w2")[0] == QuantFormat("fp8", "fp8")
    assert recipe.resolve("m.experts.0.w2") == (None, recipe.entries[-1])
    assert recipe.resolve("m.dense.w2")[0] == QuantFormat("nvfp4", None)
    assert recipe.resolve("m.other")[0] == NVFP4


def test_router_and_expert_patterns_are_precise():
    recipe = load_recipe("nvfp4")
    moe = f"{LM}.layers.1.block_sparse_moe"
    assert recipe.resolve(f"{moe}.shared_experts.gate_proj")[0] == NVFP4
    assert recipe.resolve(f"{LM}.layers.0.mlp.gate_proj")[0] == NVFP4
    assert recipe.resolve(f"{LM}.layers.1.self_attn.g_proj")[0] is None  # units/engine_bf16
    assert recipe.resolve(f"{moe}.gate")[0] is None
    only = load_recipe("nvfp4_experts_only")
    assert only.resolve(f"{moe}.experts")[0] == NVFP4  # fused experts module
    assert only.resolve(f"{moe}.shared_experts.down_proj")[0] is None


def test_overrides_and_roundtrip():
    recipe = load_recipe("nvfp4", overrides=parse_overrides(["kv_cache=fp8", "calibrate_all_experts=true"]))
    assert recipe.kv_cache is KV_FP8 and recipe.calibrate_all_experts
    recipe = load_recipe("nvfp4", overrides={"quant_cfg": [{"pattern": "*lm_head", "weights": "fp8",
                                                             "inputs": "fp8"}]})
    assert recipe.resolve("language_model.lm_head")[0] == QuantFormat("fp8", "fp8")
    again = recipe_from_dict(recipe.to_dict(), name=recipe.name)
    assert [(e.pattern, e.format, e.must_match, e.reason) for e in again.entries] == [
        (e.pattern, e.format, e.must_match, e.reason) for e in recipe.entries]
    with pytest.raises(RecipeError, match=r"overrides: unknown key 'kv_cache_qformat'"):
        load_recipe("nvfp4", overrides={"kv_cache_qformat": "fp8"})
    with pytest.raises(RecipeError, match=r"overrides: kv_cache 'int8' is not supported"):
        load_recipe("nvfp4", overrides={"kv_cache": "int8"})


def test_entry_type_is_hashable_and_frozen():
    entry = RecipeEntry("*", NVFP4, None, False, "x")
    with pytest.raises(AttributeError):
        entry.pattern = "y"  # type: ignore[misc]
    assert Recipe("r", None, (entry,)).resolve("a.b") == (NVFP4, entry)


def test_compressed_tensors_scheme_alias():
    pytest.importorskip("compressed_tensors")
    recipe = recipe_from_dict({"quant_cfg": [
        {"pattern": "*a", "scheme": "NVFP4"},
        {"pattern": "*b", "scheme": "NVFP4A16"},
        {"pattern": "*c", "scheme": "FP8"},
        {"pattern": "*d", "scheme": "NVFP4", "input_amax": 2688},
    ]})
    assert [e.format for e in recipe.entries] == [
        NVFP4, QuantFormat("nvfp4", None), QuantFormat("fp8", "fp8"), QuantFormat("nvfp4", "nvfp4", 2688.0)]
    with pytest.raises(RecipeError, match=r"<inline>: quant_cfg\[0\] pattern '\*': scheme 'W4A16'.*no counterpart"):
        recipe_from_dict({"quant_cfg": [{"pattern": "*", "scheme": "W4A16"}]})
    with pytest.raises(RecipeError, match=r"either scheme or weights"):
        recipe_from_dict({"quant_cfg": [{"pattern": "*", "scheme": "FP8", "weights": "fp8"}]})


# --------------------------------------------------------------------------- bad recipes


BAD_CASES = {
    "unknown_entry_key": (
        """\
        quant_cfg:
          - pattern: "*"
            weights: nvfp4
            inputs: nvfp4
          - pattern: "*x"
            weight: fp8
        """,
        r"bad\.yaml: quant_cfg\[1\]: unknown key 'weight' in a quant_cfg entry; allowed keys: pattern, enable",
    ),
    "unknown_top_key": (
        """\
        quantcfg: []
        """,
        r"bad\.yaml: unknown key 'quantcfg' in a recipe; allowed keys: .*quant_cfg",
    ),
    "bad_weights_value": (
        """\
        quant_cfg:
          - pattern: "*"
            weights: nvfp5
            inputs: nvfp4
        """,
        r"bad\.yaml: quant_cfg\[0\] pattern '\*': weights: unknown format 'nvfp5'; expected nvfp4 \| fp8 \| fp8_pb",
    ),
    "bad_inputs_value": (
        """\
        quant_cfg:
          - pattern: "*"
            weights: fp8
            inputs: int8
        """,
        r"bad\.yaml: quant_cfg\[0\] pattern '\*': inputs: unknown format 'int8'",
    ),
    "unnamed_combo": (
        """\
        quant_cfg:
          - pattern: "*"
            weights: fp8
            inputs: null
        """,
        r"bad\.yaml: quant_cfg\[0\] pattern '\*': weights=fp8 with inputs=null has no ModelOpt quant_algo",
    ),
    "negative_amax": (
        """\
        quant_cfg:
          - pattern: "*"
            weights: nvfp4
            inputs: nvfp4
            input_amax: -1.0
        """,
        r"bad\.yaml: quant_cfg\[0\] pattern '\*': input_amax must be a finite number > 0, got -1\.0",
    ),
    "string_amax": (
        """\
        quant_cfg:
          - pattern: "*"
            weights: nvfp4
            inputs: nvfp4
            input_amax: 1e3
        """,
        r"bad\.yaml: quant_cfg\[0\] pattern '\*': input_amax must be a number, got the string '1e3'",
    ),
    "amax_weight_only": (
        """\
        quant_cfg:
          - pattern: "*"
            weights: nvfp4
            inputs: null
            input_amax: 2688.0
        """,
        r"bad\.yaml: quant_cfg\[0\] pattern '\*': input_amax needs quantized inputs",
    ),
    "bad_must_match_type": (
        """\
        quant_cfg:
          - pattern: "*"
            weights: nvfp4
            inputs: nvfp4
            must_match: "yes please"
        """,
        r"bad\.yaml: quant_cfg\[0\] pattern '\*': must_match must be true or false",
    ),
    "pattern_not_string": (
        """\
        quant_cfg:
          - pattern: 3
            enable: false
        """,
        r"bad\.yaml: quant_cfg\[0\]: pattern must be a string, got 3",
    ),
    "missing_inputs": (
        """\
        quant_cfg:
          - pattern: "*"
            weights: nvfp4
        """,
        r"bad\.yaml: quant_cfg\[0\] pattern '\*': weights is set but inputs is not; write inputs: null",
    ),
    "disabled_with_format": (
        """\
        quant_cfg:
          - pattern: "*"
            enable: false
            weights: nvfp4
        """,
        r"bad\.yaml: quant_cfg\[0\] pattern '\*': a disabled entry \(enable: false\) takes no weights",
    ),
    # The recipe layer checks the algorithm's syntax; its methods and options are the calibrators' registry's
    # (test_an_unknown_algorithm_is_refused_by_the_registry).
    "bad_algorithm": (
        """\
        algorithm: {method: mse, step_size: [0.1]}
        quant_cfg: [{pattern: "*", weights: nvfp4, inputs: nvfp4}]
        """,
        r"bad\.yaml: algorithm mse option 'step_size' must be a name with a scalar value, got \[0\.1\]",
    ),
    "quant_cfg_not_list": (
        """\
        quant_cfg: {pattern: "*"}
        """,
        r"bad\.yaml: quant_cfg must be a list",
    ),
    "missing_import": (
        """\
        quant_cfg:
          - pattern: "*"
            weights: nvfp4
            inputs: nvfp4
          - import: units/does_not_exist
        """,
        r"bad\.yaml: quant_cfg\[1\]: import 'units/does_not_exist' not found; tried: ",
    ),
    "missing_top_import": (
        """\
        imports: [./nope]
        quant_cfg: []
        """,
        r"bad\.yaml: imports\[0\]: import './nope' not found",
    ),
    "import_with_extra_key": (
        """\
        quant_cfg:
          - import: units/default_disabled
            pattern: "*"
        """,
        r"bad\.yaml: quant_cfg\[0\]: an import item takes only the key 'import'",
    ),
    "python_tag": (
        """\
        quant_cfg:
          - pattern: !!python/object/apply:os.system ["echo pwned"]
            enable: false
        """,
        r"bad\.yaml: not valid \(safe\) YAML: .*python/object",
    ),
    "empty": ("", r"bad\.yaml: the file is empty"),
    "not_mapping": ("- a\n- b\n", r"bad\.yaml: the top level must be a mapping"),
    "no_entries": ("algorithm: max\n", r"bad\.yaml: the recipe has no quant_cfg entries"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_recipe_errors(tmp_path, case):
    text, pattern = BAD_CASES[case]
    path = write(tmp_path, "bad.yaml", text)
    with pytest.raises(RecipeError, match=pattern):
        load_recipe(path)


def test_circular_import_names_the_chain(tmp_path):
    write(tmp_path, "a.yaml", """\
        quant_cfg:
          - pattern: "*"
            weights: nvfp4
            inputs: nvfp4
          - import: ./b
        """)
    write(tmp_path, "b.yaml", "imports: [./c.yaml]\n")
    write(tmp_path, "c.yaml", "quant_cfg:\n  - import: ./b\n")
    with pytest.raises(RecipeError, match=r"c\.yaml: quant_cfg\[0\]: circular import: .*a\.yaml -> .*b\.yaml -> "
                                          r".*c\.yaml -> .*b\.yaml"):
        load_recipe(tmp_path / "a.yaml")


def test_imported_file_must_be_a_unit(tmp_path):
    write(tmp_path, "unit.yaml", "kv_cache: fp8\nquant_cfg: []\n")
    path = write(tmp_path, "r.yaml", "imports: [./unit]\nquant_cfg: [{pattern: '*', weights: fp8, inputs: fp8}]\n")
    with pytest.raises(RecipeError, match=r"unit\.yaml: unknown key 'kv_cache' in an imported unit"):
        load_recipe(path)


def test_error_inside_unit_names_unit_entry(tmp_path):
    write(tmp_path, "unit.yaml", "quant_cfg:\n  - pattern: '*'\n    enable: nope\n")
    path = write(tmp_path, "r.yaml", "quant_cfg: [{import: ./unit}]\n")
    with pytest.raises(RecipeError, match=r"unit\.yaml: quant_cfg\[0\] pattern '\*': enable must be true or false"):
        load_recipe(path)


def test_check_against_must_match_nothing(tmp_path):
    path = write(tmp_path, "mm.yaml", """\
        quant_cfg:
          - pattern: "*"
            weights: nvfp4
            inputs: nvfp4
          - pattern: "*.mixer.*"
            weights: fp8_pb
            inputs: null
            must_match: true
        """)
    recipe = load_recipe(path)
    with pytest.raises(RecipeError, match=r"mm\.yaml: quant_cfg\[1\] pattern '\*\.mixer\.\*': must_match is set "
                                          r"but the pattern matches none"):
        recipe.check_against({"m.layers.0.q_proj": (64, 64)})
    # The shipped experts-only preset refuses a model without block_sparse_moe experts.
    with pytest.raises(RecipeError, match=r"nvfp4_experts_only\.yaml: quant_cfg\[0\] pattern "):
        load_recipe("nvfp4_experts_only").check_against({"model.layers.0.mlp.experts.0.gate_proj": (64, 64)})


def test_check_against_nvfp4_shape(tmp_path):
    path = write(tmp_path, "x.yaml", """\
        quant_cfg:
          - pattern: "*"
            weights: fp8_pb
            inputs: null
          - pattern: "*q_proj"
            weights: nvfp4
            inputs: nvfp4
        """)
    recipe = load_recipe(path)
    bad = "language_model.model.layers.1.self_attn.q_proj"
    with pytest.raises(RecipeError, match=rf"x\.yaml: quant_cfg\[1\] pattern '\*q_proj': layer {bad} "
                                          r"in_features=200 is not divisible by 16, NVFP4 cannot take it"):
        recipe.check_against({bad: (64, 200), "m.b_proj": (96, 200)})  # fp8_pb takes any shape
    recipe.check_against({"m.q_proj": (96, 208), "m.b_proj": (96, 200)})


def test_recipe_roots_are_resolved_once_per_load(monkeypatch):
    """The recipe and every file it imports resolve names against one search path, found once."""
    from modelopt_k3.recipe import finder

    calls: list[int] = []
    current = finder.RecipeRoots.current.__func__
    monkeypatch.setattr(finder.RecipeRoots, "current", classmethod(lambda cls: calls.append(1) or current(cls)))
    recipe = load_recipe(MIRROR)
    assert calls == [1]
    assert any("imported at" in entry.source for entry in recipe.entries)  # it did import a unit
