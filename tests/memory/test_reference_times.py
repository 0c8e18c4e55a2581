"""docs/MEMORY.md's "How long it takes" table is what the memory planner and the wall-time model say today, on
header-only full-size Kimi-K3 and DeepSeek-V3 layouts (``memory/reference_times.py`` writes it): a change to
either model turns this red until the table is regenerated."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelopt_k3.memory.reference_times import HEADER, reference_table
from modelopt_k3.testing.full_size import full_size_layouts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("restore_remote_code")]
DOC = Path(__file__).resolve().parents[2] / "docs" / "MEMORY.md"


def _doc_table() -> str:
    lines = DOC.read_text().splitlines()
    start = lines.index(HEADER)
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])


def test_docs_table_is_the_models_output(tmp_path: Path) -> None:
    table = reference_table(full_size_layouts(tmp_path))
    assert _doc_table() == table
    # The case the table makes: a node finishes a fraction of one GPU's layerwise time, for both models.
    rows = [r.split("|")[1:-1] for r in table.splitlines()[2:]]
    speedups = {(r[0].strip(), r[1].strip()): float(r[-1].strip().removesuffix("x"))
                for r in rows if r[2].strip() == "layerwise" and r[-1].strip().endswith("x")}
    assert all(speedups[(m, "8 x H200")] > 4 for m in ("Kimi-K3", "DeepSeek-R1"))
