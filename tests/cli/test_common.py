"""How the command line tools print a distributed failure (cli/_common.py): one line per group of ranks."""

from __future__ import annotations

from modelopt_k3.cli._common import failure_lines
from modelopt_k3.dist.collectives import DistributedStepError


def test_failures_are_one_line_per_group_of_ranks_printed_by_rank_0() -> None:
    failures = {0: "ValueError: a\nb", 1: "ValueError: a\nb", 2: "ValueError: a\nb", 5: "LoadError: c"}
    seen_by_0 = DistributedStepError("load", failures, rank=0)
    assert failure_lines(seen_by_0) == ["load failed on ranks 0-2: ValueError: a b", "load failed on rank 5: LoadError: c"]
    assert failure_lines(DistributedStepError("load", failures, rank=3)) is None
    # A peer died before the ranks could agree: every rank reports what it saw.
    assert failure_lines(DistributedStepError("load", {}, rank=3, note="peer gone")) == [
        "step 'load' failed (seen from rank 3): peer gone"]
