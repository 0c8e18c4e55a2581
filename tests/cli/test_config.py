"""``PtqConfig``: the typed, frozen settings of ``modelopt-k3-ptq`` (issue 27), the same from the command line
and from Python."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from modelopt_k3.cli.hf_ptq import build_parser
from modelopt_k3.run.plan import PtqConfig


def _parsed(*argv: str) -> PtqConfig:
    return PtqConfig.from_namespace(build_parser().parse_args(list(argv)))


def test_one_field_per_flag_with_the_parsers_defaults():
    dests = {a.dest for a in build_parser()._actions if a.dest != "help"}
    assert {f.name for f in dataclasses.fields(PtqConfig)} == dests
    assert _parsed() == PtqConfig()  # the defaults agree: a Python caller gets the CLI's run


def test_typed_and_frozen():
    config = _parsed("--pyt_ckpt_path", "ckpt", "--export_format", "compressed-tensors", "--calib_size", "3")
    assert config.pyt_ckpt_path == Path("ckpt") and config.calib_size == 3
    assert config.export_format == "compressed-tensors" and type(config.export_format).__name__ == "ExportFormatName"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.calib_size = 4  # type: ignore[misc]
    assert PtqConfig(pyt_ckpt_path="x").pyt_ckpt_path == Path("x")
    assert _parsed("--uncovered_experts", "calibrate_all").calibrate_every_expert
    assert _parsed("--calibrate_all_experts").calibrate_every_expert and not PtqConfig().calibrate_every_expert


@pytest.mark.parametrize(("field", "value", "message"), [
    ("calib_size", 0, "calib_size must be a positive integer, got 0"),
    ("eval_kl", -1, "eval_kl must be a non-negative integer, got -1"),
    ("report_heldout", -1, "report_heldout must be a non-negative integer, got -1"),
    ("min_expert_tokens", -1, "min_expert_tokens must be a non-negative integer, got -1"),
    ("max_shard_size_mb", 0, "max_shard_size_mb must be a positive integer, got 0"),
    ("ep_degree", 0, "ep_degree must be a positive integer, got 0"),
    ("plan", "ring", "plan='ring'; choose one of \\['auto', 'whole', 'fsdp2', 'expert_parallel'\\]"),
    ("export_format", "gguf", "export_format='gguf'; choose one of \\['modelopt', 'compressed-tensors'\\]"),
    ("uncovered_experts", "ignore", "uncovered_experts='ignore'"),
])
def test_python_callers_get_the_parsers_checks(field, value, message):
    with pytest.raises(ValueError, match=message):
        PtqConfig(**{field: value})


def test_a_namespace_with_a_flag_the_config_lacks_is_refused():
    args = build_parser().parse_args([])
    args.new_flag = 1
    with pytest.raises(ValueError, match="PtqConfig has no field for new_flag"):
        PtqConfig.from_namespace(args)
