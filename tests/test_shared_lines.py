"""scripts/shared_lines.py: what it counts as coinciding with a public file, and what it lets through."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "shared_lines.py"


@pytest.fixture(scope="module")
def sl():
    spec = importlib.util.spec_from_file_location("shared_lines_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _count(sl, tmp_path: Path, ours: str, ref: str, min_run: int = 4) -> int:
    (tmp_path / "ours.py").write_text(ours)
    (tmp_path / "ref.py").write_text(ref)
    views = [sl.normalize(ref)]
    indexes = tuple(sl.build_index([[s for _, s in v[k]] for v in views]) for k in range(2))
    return sl.compare(tmp_path / "ours.py", indexes, min_run)[0]


BODY = """
def f(x, y):
    a = x * 2 + y
    b = torch.tanh(a) * a
    c = b.sum(-1) / a.numel()
    d = torch.cat([a, b], dim=0)
    return d.view(-1)[c > 0]
"""


def test_a_shared_run_counts_despite_comments_whitespace_and_docstrings(sl, tmp_path: Path) -> None:
    ours = '"""ours."""\n\ndef f(x, y):\n    """Doc."""\n    a = x*2 + y  # note\n\n    b = torch.tanh(a)*a\n' \
           "    c = b.sum(-1) / a.numel()\n    d = torch.cat([a, b], dim=0)\n    return d.view(-1)[c > 0]\n"
    # 5 shared statements (the def line is declarative, so it lengthens the run but is not counted).
    assert _count(sl, tmp_path, ours, BODY) == 5


def test_runs_shorter_than_min_run_are_not_counted(sl, tmp_path: Path) -> None:
    ours = "def g(x, y):\n    a = x * 2 + y\n    b = torch.tanh(a) * a\n    z = 1\n    d = torch.cat([a, b], dim=0)\n"
    assert _count(sl, tmp_path, ours, BODY) == 0  # runs of 2 (a, b) and 1 (d)
    assert _count(sl, tmp_path, ours, BODY, min_run=2) == 2


def test_a_wrapped_statement_matches_its_one_line_form(sl, tmp_path: Path) -> None:
    ref = "x = compute(alpha, beta)\ny = x.sum(-1) + x.mean(-1)\nz = y * y - 1\nw = torch.stack([x, y, z])\n"
    ours = "x = compute(\n    alpha,\n    beta,\n)\ny = x.sum(-1) + x.mean(-1)\nz = y * y - 1\nw = torch.stack(\n    [x, y, z]\n)\n"
    assert _count(sl, tmp_path, ours, ref.replace("beta)", "beta,)")) == 4


def test_declarative_lines_lengthen_runs_but_are_not_counted(sl, tmp_path: Path) -> None:
    text = (
        "import torch\nfrom torch import nn\n\n\nclass A(nn.Module):\n    def __init__(self, config):\n"
        "        super().__init__()\n        self.width = config.width\n        self.depth = getattr(config, 'depth', 2)\n"
        "        self.proj = nn.Linear(self.width, 2 * self.width, bias=False)\n"
    )
    assert _count(sl, tmp_path, text, text) == 1  # only the nn.Linear line is not declarative


@pytest.mark.parametrize(
    ("line", "declarative"),
    [
        ("fromtransformers.utilsimportlogging", True),
        ("classKimiRMSNorm(nn.Module):", True),
        ("defforward(self,x:torch.Tensor)->torch.Tensor:", True),
        ("input_embeds=inputs_embeds,", True),
        ("self.top_k=config.num_experts_per_token", True),
        ("_no_split_modules=[", True),
        ("hidden_states=hidden_states.view(-1,dim)", False),
        ("returnself.weight*x.to(dtype)", False),
        ("ifself.use_latent_moe:", False),
    ],
)
def test_declarative_classification(sl, line: str, declarative: bool) -> None:
    assert sl.is_declarative(line) is declarative
