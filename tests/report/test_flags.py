"""hf_ptq's report flags: how many held-out sequences, where the report goes, which policies exist."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelopt_k3.cli import hf_ptq
from modelopt_k3.files.paths import DestinationError
from modelopt_k3.run.plan import PtqConfig


def _args(*argv: str):
    return PtqConfig.from_namespace(hf_ptq.build_parser().parse_args(list(argv)))


@pytest.mark.parametrize(("argv", "world", "expected"), [
    ((), 1, 1), ((), 4, 4), (("--report", "none"), 4, 0), (("--eval_kl", "3"), 4, 3),
    (("--report_heldout", "5", "--eval_kl", "3"), 1, 5), (("--report_heldout", "0", "--eval_kl", "2"), 1, 2),
    (("--report", "none", "--report_heldout", "0"), 2, 0),
])
def test_held_out_count(argv, world, expected):
    assert hf_ptq._held_out_count(_args(*argv), world) == expected


def test_report_dir(tmp_path: Path):
    src, export = tmp_path / "src", tmp_path / "export"
    src.mkdir()
    assert hf_ptq._report_dir(_args(), export, src) == export / "quant_report"
    assert hf_ptq._report_dir(_args("--report", "none"), export, src) is None
    assert hf_ptq._report_dir(_args("--report", str(tmp_path / "r")), export, src) == tmp_path / "r"
    with pytest.raises(DestinationError, match="--report .* lies inside the source checkpoint"):
        hf_ptq._report_dir(_args("--report", str(src / "r")), export, src)


def test_policies_and_threshold(capsys):
    args = _args("--uncovered_experts", "calibrate_all", "--min_expert_tokens", "0")
    assert (args.uncovered_experts, args.min_expert_tokens) == ("calibrate_all", 0)
    with pytest.raises(SystemExit):
        _args("--uncovered_experts", "ignore")
    assert "invalid choice: 'ignore'" in capsys.readouterr().err
