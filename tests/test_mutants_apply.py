"""Every hand-written mutant of ``scripts/mutate.py`` still names code that exists: a mutant whose text moved
away no longer mutates anything, and ``mutate.py --only`` would report it as an error instead of a kill, long
after the change that moved it. Checked here, where the change is made."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _mutate_module():
    spec = importlib.util.spec_from_file_location("modelopt_k3_mutate_script", REPO / "scripts" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_every_curated_mutant_names_text_found_once_in_its_file() -> None:
    mutate = _mutate_module()
    stale = []
    for m in mutate.CURATED:
        path = REPO / m.path
        count = path.read_text().count(m.old) if path.exists() else -1
        if count != 1:
            stale.append(f"{m.id}: {m.old!r} found {count} time(s) in {m.path}")
    assert not stale, "update these mutants to today's code:\n" + "\n".join(stale)
