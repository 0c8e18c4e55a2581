"""``modelopt-k3-report --compare A B``: two reports side by side with B/A.

Most tests build report.json documents by hand (the comparison reads only the JSON), so every expected
number is known: a compare that swaps A and B, divides the wrong way, drops a module or fails to name one
fails here. One slow test compares two real hf_ptq exports (max and nvfp4_mse) of the tiny Qwen3-MoE.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest

from modelopt_k3.cli import report as report_cli
from modelopt_k3.files.paths import OWNED_RECORD
from modelopt_k3.report.compare import CompareError, compare, ratio

CKPT = "/models/tiny"
DENSE = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "model.layers.10.self_attn.o_proj"]
EXPERTS = "model.layers.0.mlp.experts.*.down_proj"


def _module(name: str, rel_rms: float, max_abs: float, algo: str | None, kind: str = "linear") -> dict:
    m = {"name": name, "kind": kind, "algo": "nvfp4", "calibration": "label", "weight_format": "nvfp4",
         "weight": {"rel_rms": rel_rms, "max_abs_err": max_abs, "rel_max_err": 0.1, "amax": 1.0},
         "weight_scale": 0.01, "input": None}
    if algo is not None:
        m["weight_algorithm"] = algo
    return m


def _report(errors: list[float], algo: str, *, kl: float = 0.05, layers=(0.2, 0.3), recipe: str = "r",
            checkpoint: str = CKPT, version: int = 2) -> dict:
    """A report of the three dense modules (errors[0..2]) and one experts projection (errors[3])."""
    modules = [_module(n, e, e / 2, algo if version >= 2 else None) for n, e in zip(DENSE, errors)]
    experts = [_module(EXPERTS, errors[3], errors[3] / 2, algo if version >= 2 else None, kind="experts")]
    return {"schema": "modelopt_k3.quant_report", "version": version,
            "run": {"checkpoint": checkpoint, "recipe": recipe, "world_size": 1, "plan": "whole"},
            "modules": modules, "experts": experts,
            "coverage": {"min_expert_tokens": 1, "policy": "refuse", "counted": False, "layers": []},
            "layers": [{"name": f"model.layers.{i}", "index": i, "hidden_rel_rms": v, "sse": 1.0, "ssq": 1.0}
                       for i, v in enumerate(layers)],
            "final": None if kl is None else {"kl": kl, "top1_agreement": 0.8, "tokens": 64}}


A_ERR, B_ERR = [0.1, 0.2, 0.08, 0.12], [0.05, 0.3, 0.08, 0.06]


def _write(path: Path, data) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "report.json").write_text(json.dumps(data))
    return path


@pytest.fixture
def two(tmp_path):
    a = _write(tmp_path / "a", _report(A_ERR, "max", kl=0.04, layers=(0.2, 0.4), recipe="max_recipe"))
    b = _write(tmp_path / "b", _report(B_ERR, "mse", kl=0.01, layers=(0.1, 0.5), recipe="mse_recipe"))
    return a, b


def _cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = report_cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_error(rc: int, err: str) -> str:
    assert rc == 2 and err.count("\n") == 1 and err.startswith("modelopt-k3-report: error: "), (rc, err)
    return err


def test_ratios_are_b_over_a_per_module_layer_and_kl():
    cmp = compare(_report(A_ERR, "max", kl=0.04, layers=(0.2, 0.4)), _report(B_ERR, "mse", kl=0.01, layers=(0.1, 0.5)))
    by_name = {m["name"]: m for m in cmp["modules"]}
    assert set(by_name) == {*DENSE, EXPERTS}
    for name, a, b in zip([*DENSE, EXPERTS], A_ERR, B_ERR):
        m = by_name[name]
        assert (m["a"]["rel_rms"], m["b"]["rel_rms"]) == (a, b), name
        assert m["rel_rms_ratio"] == pytest.approx(b / a), name
        assert m["max_abs_err_ratio"] == pytest.approx(b / a), name  # max_abs = rel_rms / 2 on both sides
        assert (m["a"]["weight_algorithm"], m["b"]["weight_algorithm"]) == ("max", "mse")
    assert by_name[DENSE[1]]["rel_rms_ratio"] == pytest.approx(1.5)  # B worse there
    assert [(r["a"], r["b"], r["ratio"]) for r in cmp["layers"]] == [(0.2, 0.1, pytest.approx(0.5)),
                                                                    (0.4, 0.5, pytest.approx(1.25))]
    assert cmp["final"]["kl"] == {"a": 0.04, "b": 0.01, "ratio": pytest.approx(0.25)}
    s = cmp["summary"]
    assert (s["modules"], s["with_ratio"], s["b_lower"], s["b_higher"], s["equal"]) == (4, 4, 2, 1, 1)
    assert s["geomean_rel_rms_ratio"] == pytest.approx((0.5 * 1.5 * 1.0 * 0.5) ** 0.25)
    assert (s["min_rel_rms_ratio"], s["max_rel_rms_ratio"]) == (pytest.approx(0.5), pytest.approx(1.5))
    # natural layer order: layers.10 after layers.1
    assert [m["name"] for m in cmp["modules"]] == [EXPERTS, DENSE[0], DENSE[1], DENSE[2]]


def test_swapping_a_and_b_inverts_every_ratio():
    a, b = _report(A_ERR, "max", kl=0.04), _report(B_ERR, "mse", kl=0.01)
    forward, backward = compare(a, b), compare(b, a)
    for f, r in zip(forward["modules"], backward["modules"]):
        assert f["name"] == r["name"] and f["a"] == r["b"] and f["b"] == r["a"]
        assert f["rel_rms_ratio"] * r["rel_rms_ratio"] == pytest.approx(1.0)
    assert forward["final"]["kl"]["ratio"] == pytest.approx(0.25) and backward["final"]["kl"]["ratio"] == pytest.approx(4)


def test_an_exact_a_has_no_ratio():
    assert ratio(0.0, 0.0) is None and ratio(0.0, 0.1) is None and ratio(None, 0.1) is None and ratio(0.1, None) is None
    assert ratio(0.2, 0.1) == 0.5
    cmp = compare(_report([0.0, 0.2, 0.08, 0.0], "lossless_cast"), _report([0.0, 0.2, 0.08, 0.0], "lossless_cast"))
    assert [m["rel_rms_ratio"] for m in cmp["modules"]] == [None, None, 1.0, 1.0]
    assert cmp["summary"]["with_ratio"] == 2


def test_markdown_table_on_stdout(two, capsys):
    a, b = two
    rc, out, err = _cli(capsys, "--compare", a, b)
    assert rc == 0 and err == ""
    row = next(line for line in out.splitlines() if line.startswith(f"| `{DENSE[1]}`"))
    # module | A scales by | B scales by | A rel. RMS | B rel. RMS | B / A | ...
    assert [c.strip() for c in row.strip("|").split("|")][:6] == [f"`{DENSE[1]}`", "max", "mse", "0.2", "0.3", "1.5"]
    kl = next(line for line in out.splitlines() if line.startswith("| KL"))
    assert kl.endswith("| 0.04 | 0.01 | 0.25 |"), kl
    layer1 = next(line for line in out.splitlines() if line.startswith("| 1 | `model.layers.1`"))
    assert layer1.endswith("| 0.4 | 0.5 | 1.25 |")
    assert f"A: `{a}` (recipe `max_recipe`" in out and f"B: `{b}` (recipe `mse_recipe`" in out


def test_out_writes_md_json_png_through_write_owned(two, tmp_path, capsys):
    a, b = two
    out = tmp_path / "cmp"
    rc, stdout, _ = _cli(capsys, "--compare", a, b, "--out", out)
    assert rc == 0 and sorted(p.name for p in out.iterdir()) == sorted([OWNED_RECORD, "compare.md", "compare.json",
                                                                       "compare.png"])
    assert stdout.split() == [str(out / n) for n in ("compare.md", "compare.json", "compare.png")]
    data = json.loads((out / "compare.json").read_text())
    assert data["schema"] == "modelopt_k3.quant_report_compare" and data["a"]["recipe"] == "max_recipe"
    assert data["modules"] == compare(json.loads((a / "report.json").read_text()),
                                      json.loads((b / "report.json").read_text()))["modules"]
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| B / A |" in (out / "compare.md").read_text()
    assert set(json.loads((out / OWNED_RECORD).read_text())["files"]) == {"compare.md", "compare.json", "compare.png"}
    assert _cli(capsys, "--compare", b, a, "--out", out)[0] == 0  # ours: replaced
    assert json.loads((out / "compare.json").read_text())["a"]["recipe"] == "mse_recipe"
    (out / "compare.md").write_text("the user's notes")
    _one_line_error(*_cli(capsys, "--compare", a, b, "--out", out)[::2])
    assert (out / "compare.md").read_text() == "the user's notes"


def test_a_module_on_one_side_only_is_named(two, tmp_path, capsys):
    a, _ = two
    data = _report(B_ERR, "mse")
    data["modules"] = [m for m in data["modules"] if m["name"] != DENSE[1]]
    data["experts"].append(_module("model.layers.3.mlp.experts.*.up_proj", 0.1, 0.1, "mse", kind="experts"))
    b = _write(tmp_path / "b2", data)
    err = _one_line_error(*_cli(capsys, "--compare", a, b)[::2])
    assert f"1 only in A ({a}): {DENSE[1]}" in err, err
    assert f"1 only in B ({b}): model.layers.3.mlp.experts.*.up_proj" in err, err
    assert DENSE[0] not in err
    extra = _report(B_ERR, "mse")  # B quantized one module more, nothing missing
    extra["modules"].append(_module("lm_head", 0.1, 0.1, "mse"))
    b = _write(tmp_path / "b4", extra)
    err = _one_line_error(*_cli(capsys, "--compare", a, b)[::2])
    assert err.endswith(f"A and B quantized different modules: 1 only in B ({b}): lm_head\n"), err
    err = _one_line_error(*_cli(capsys, "--compare", b, a)[::2])
    assert err.endswith(f"A and B quantized different modules: 1 only in A ({b}): lm_head\n"), err


def test_different_checkpoints_are_refused_naming_both(two, tmp_path, capsys):
    a, _ = two
    b = _write(tmp_path / "other", _report(B_ERR, "mse", checkpoint="/models/another"))
    err = _one_line_error(*_cli(capsys, "--compare", a, b)[::2])
    assert f"A ({a}) of {CKPT}" in err and f"B ({b}) of /models/another" in err, err
    rc, out, _ = _cli(capsys, "--compare", a, b, "--any_checkpoint")
    assert rc == 0 and "(A) and `/models/another` (B)" in out


def test_different_layers_are_refused(two, tmp_path, capsys):
    a, _ = two
    b = _write(tmp_path / "b3", _report(B_ERR, "mse", layers=(0.1, 0.2, 0.3)))
    err = _one_line_error(*_cli(capsys, "--compare", a, b)[::2])
    assert "different decoder layers (2 vs 3; differing: model.layers.2)" in err, err


def test_a_side_without_held_out_pass_is_listed_not_compared():
    cmp = compare(_report(A_ERR, "max", kl=None, layers=()), _report(B_ERR, "mse"))
    assert cmp["layers"] == [] and cmp["final"] is None
    assert cmp["not_compared"] == ["per-layer hidden-state error: A had no held-out pass",
                                   "final logits (KL, top-1): A had no held-out pass"]
    assert len(cmp["modules"]) == 4


def test_a_version_1_report_still_compares(tmp_path, capsys):
    a = _write(tmp_path / "v1", _report(A_ERR, "max", version=1))
    b = _write(tmp_path / "v2", _report(B_ERR, "mse"))
    rc, out, _ = _cli(capsys, "--compare", a, b)
    assert rc == 0 and "report v1" in out
    row = next(line for line in out.splitlines() if line.startswith(f"| `{DENSE[0]}`"))
    assert [c.strip() for c in row.strip("|").split("|")][1:3] == ["-", "mse"]
    assert compare(_report(A_ERR, "max", version=1), _report(B_ERR, "mse"))["modules"][0]["a"]["weight_algorithm"] is None


@pytest.mark.parametrize("case", ["missing", "malformed", "not-an-object", "wrong-schema", "newer-version",
                                  "wrong-type", "symlink-loop"])
def test_bad_inputs_answer_in_one_line(case, two, tmp_path, capsys):
    a, _ = two
    b = tmp_path / "bad"
    b.mkdir()
    path = b / "report.json"
    bodies = {"malformed": "{", "not-an-object": "[1]",
              "wrong-schema": json.dumps({"schema": "something", "version": 1}),
              "newer-version": json.dumps({**_report(B_ERR, "mse"), "version": 99})}
    if case == "wrong-type":
        data = _report(B_ERR, "mse")
        data["modules"][0]["weight"]["rel_rms"] = "0.1"
        path.write_text(json.dumps(data))
    elif case == "symlink-loop":
        os.symlink("report.json", path)
    elif case != "missing":
        path.write_text(bodies[case])
    out = tmp_path / "out"
    rc, stdout, err = _cli(capsys, "--compare", a, b, "--out", out)
    err = _one_line_error(rc, err)
    assert "B: " in err or "B (" in err, err
    assert str(b) in err, err
    if case == "wrong-type":
        assert "modules[0].weight.rel_rms is a str" in err, err
    assert stdout == "" and not out.exists()
    # and as A: the error names A
    err = _one_line_error(*_cli(capsys, "--compare", b, a)[::2])
    assert "A: " in err or "A (" in err, err


def test_compare_and_path_are_exclusive(two, capsys):
    a, b = two
    with pytest.raises(SystemExit) as e:
        report_cli.main([str(a), "--compare", str(a), str(b)])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        report_cli.main([str(a), "--any_checkpoint"])
    with pytest.raises(CompareError, match="twice"):
        doubled = _report(A_ERR, "max")
        doubled["modules"].append(copy.deepcopy(doubled["modules"][0]))
        compare(doubled, _report(A_ERR, "max"))


def _hf_ptq(ckpt: Path, out: Path, qformat: str) -> dict:
    from modelopt_k3.cli import hf_ptq

    argv = ["--pyt_ckpt_path", str(ckpt), "--export_path", str(out), "--qformat", qformat, "--calib_size", "2",
            "--batch_size", "2", "--calib_seq", "16", "--no_progress", "--uncovered_experts", "shared"]
    assert hf_ptq.main(argv) == 0
    return json.loads((out / "quant_report" / "report.json").read_text())


@pytest.mark.slow
def test_max_and_mse_exports_of_the_tiny_qwen3_moe(tmp_path, capsys):
    """Two hf_ptq runs (nvfp4, nvfp4_mse): every module's scales recorded as max / mse; the mse search never
    errs more than max's scales (max's are among its candidates, per block), so every B/A is <= 1."""
    from modelopt_k3.testing.qwen3_moe import make_tiny_qwen3_moe

    ckpt = make_tiny_qwen3_moe(tmp_path / "ckpt", seed=0)
    a, b = _hf_ptq(ckpt, tmp_path / "max", "nvfp4"), _hf_ptq(ckpt, tmp_path / "mse", "nvfp4_mse")
    assert {m["weight_algorithm"] for m in a["modules"] + a["experts"]} == {"max"}
    assert {m["weight_algorithm"] for m in b["modules"] + b["experts"]} == {"mse"}
    out = tmp_path / "cmp"
    rc, _, err = _cli(capsys, "--compare", tmp_path / "max", tmp_path / "mse", "--out", out)
    assert rc == 0, err
    cmp = json.loads((out / "compare.json").read_text())
    want = {m["name"]: (m["weight"]["rel_rms"], n["weight"]["rel_rms"])
            for m, n in zip(a["modules"] + a["experts"], b["modules"] + b["experts"])}
    assert len(cmp["modules"]) == len(want) == 21
    for m in cmp["modules"]:
        ea, eb = want[m["name"]]
        assert (m["a"]["rel_rms"], m["b"]["rel_rms"]) == (ea, eb), m["name"]
        assert m["rel_rms_ratio"] == pytest.approx(eb / ea) and m["rel_rms_ratio"] <= 1.0, m["name"]
    assert cmp["summary"]["b_lower"] >= 1
    assert [r["name"] for r in cmp["layers"]] == [r["name"] for r in a["layers"]] == ["model.layers.0",
                                                                                     "model.layers.1", "model.layers.2"]
    assert cmp["final"]["kl"]["ratio"] == pytest.approx(b["final"]["kl"] / a["final"]["kl"])
    assert math.isfinite(cmp["final"]["kl"]["ratio"])
    rc, stdout, _ = _cli(capsys, "--compare", tmp_path / "mse", tmp_path / "max")
    row = next(line for line in stdout.splitlines() if line.startswith("| `model.layers.1.mlp.down_proj`"))
    assert [c.strip() for c in row.strip("|").split("|")][1:3] == ["mse", "max"]
