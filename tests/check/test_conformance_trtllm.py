"""``python -m tools.conformance.trtllm`` without TensorRT-LLM: the tree's pins refuse other code in one line before
anything is built, and the replay feeds TensorRT-LLM's functions as its Kimi-K3 constructors call them (checked
here with stand-in functions of our own; the real run needs a TensorRT-LLM tree, docs/ENGINE_CONFORMANCE.md)."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tools.conformance import matrix, trtllm
from tools.conformance.drivers.stub_list import STUBS


def _tree(root: Path, source: str = "def f(x):\n    return x + 1\n") -> dict[str, dict[str, str]]:
    path = root / "pkg" / "mod.py"
    path.parent.mkdir(parents=True)
    path.write_text(source)
    node = ast.parse(source).body[0]
    return {"pkg/mod.py": {"f": trtllm.fingerprint(node)}}


def test_the_pins_accept_the_pinned_code_and_refuse_anything_else(tmp_path: Path):
    pinned = _tree(tmp_path / "a")
    assert list(trtllm.load_tree(tmp_path / "a", pinned)["pkg/mod.py"]) == ["f"]
    # Formatting, comments and docstrings are not the code: the same definition, reformatted, is accepted.
    _tree(tmp_path / "b", '# a comment\ndef f(x):  # another\n    """Doc."""\n    return (x + 1)\n')
    assert trtllm.load_tree(tmp_path / "b", pinned)
    _tree(tmp_path / "c", "def f(x):\n    return x + 2\n")
    with pytest.raises(trtllm.TreeError, match=r"pkg/mod.py f is not the pinned code") as e:
        trtllm.load_tree(tmp_path / "c", pinned)
    assert "\n" not in str(e.value)
    _tree(tmp_path / "d", "def g(x):\n    return x\n")
    with pytest.raises(trtllm.TreeError, match="defines no f"):
        trtllm.load_tree(tmp_path / "d", pinned)
    with pytest.raises(trtllm.TreeError, match="no pkg/mod.py"):
        trtllm.load_tree(tmp_path, pinned)
    with pytest.raises(trtllm.TreeError, match="not a directory"):
        trtllm.load_tree(tmp_path / "missing", pinned)


@pytest.mark.parametrize("argv, message", [
    (["--trtllm_src", "{tmp}"], "no tensorrt_llm/quantization/modelopt_config.py"),
    (["--trtllm_src", "{tmp}/none"], "not a directory"),
    (["--trtllm_src", "{tmp}", "--cells", "nope"], "--cells: unknown cell id(s) ['nope']"),
])
def test_bad_arguments_stop_before_anything_is_built(monkeypatch, tmp_path, capsys, argv, message):
    monkeypatch.setattr(matrix, "build_export", lambda *a, **k: pytest.fail("built an export"))
    with pytest.raises(SystemExit) as e:
        trtllm.main([a.format(tmp=tmp_path) for a in argv])
    assert e.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("python -m")]
    assert len(err) == 1 and message in err[0]


def test_the_pins_are_hashes_and_every_stub_says_why():
    assert all(len(h) == 64 and int(h, 16) >= 0 for names in trtllm.PINNED.values() for h in names.values())
    assert set(trtllm.SOURCES) == set(trtllm.PINNED)
    assert STUBS["trtllm"] and all(name and why for name, why in STUBS["trtllm"])
    assert {c.id for c in trtllm.MANIFEST_CELLS} <= set(trtllm.REPLAY_CELL_BY_ID)
    assert all(c.edit in matrix.EDITS and c.base in matrix.CELL_BY_ID for c in trtllm.MANIFEST_CELLS)


def _fake(calls: list) -> trtllm.Replayed:
    """Stand-ins for TensorRT-LLM's functions that record how the replay calls them."""
    qc = SimpleNamespace(quant_algo="MIXED_PRECISION")

    def attention(model_config, layer, proj):
        calls.append(("attn", layer, proj))
        if (layer, proj) == (2, "o_proj"):
            raise ValueError("refused")
        return SimpleNamespace(quant_algo="FP8_BLOCK_SCALES" if proj == "q_proj" else None)

    def routed(model_config, layer):
        calls.append(("experts", layer))
        return SimpleNamespace(quant_algo="NVFP4")

    fn = {"read_modelopt_quant_config": lambda raw: dict(raw), "is_modelopt_quant_config": lambda raw: False,
          "warn_if_inline_diverges": lambda file_quant, inline, source_file: calls.append(("warn", source_file)),
          "_build_modelopt_quant_config": lambda normalized, ckpt, backend: (qc, {"x": 1}),
          "_get_text_config": lambda c: c.text_config,
          "_is_kda_layer": lambda cfg, i: (i + 1) in cfg.linear_attn_config["kda_layers"],
          "_is_mla_layer": lambda cfg, i: (i + 1) in cfg.linear_attn_config["full_attn_layers"],
          "resolve_attention_quant_config": attention, "_resolve_routed_quant_config": routed,
          "_k3_expert_ckpt_spec": lambda algo: SimpleNamespace(kinds=("weight", "weight_scale"))}
    return trtllm.Replayed(fn, SimpleNamespace, trtllm.Log())


def test_the_replay_calls_each_layers_resolvers_as_the_k3_constructors_do(tmp_path: Path):
    text = {"num_hidden_layers": 4, "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts": 8,
            "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4]}}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": text}))
    (tmp_path / "hf_quant_config.json").write_text("{}")
    calls: list = []
    out = trtllm.replay_export(_fake(calls), tmp_path)
    kda = [("attn", i, p) for i in range(3) for p in trtllm.KDA]
    assert calls == [("warn", "hf_quant_config.json"), *kda[:5], *kda[5:10], ("experts", 1), *kda[10:], ("experts", 2),
                     *[("attn", 3, p) for p in trtllm.MLA], ("experts", 3)]
    assert out["outcome"] == "raises" and out["first_raised"] == "ValueError: refused"
    answers = {trtllm.call_key(c): trtllm.answer(c) for c in out["calls"]}
    assert answers["attn 0 q_proj"] == "FP8_BLOCK_SCALES" and answers["attn 0 k_proj"] == "unquantized"
    assert answers["experts 1"] == "NVFP4" and answers["attn 2 o_proj"] == "raises ValueError: refused"
    assert [trtllm.call_key(c) for c in trtllm.calls_of(answers)] == list(answers)
    assert trtllm.agree("raises X", "raises Y") and not trtllm.agree("raises X", "NVFP4")
    assert not trtllm.agree("NVFP4", "W4A8_MXFP4_MXFP8") and trtllm.agree("unquantized", "unquantized")
