"""No ``if model == ...`` outside the model packages: generic code reads the spec instead (issue 22).

Walks the AST of every module of ``modelopt_k3/`` except ``models/<model>/`` packages (and the stand-in's
remote code, which is the checkpoint's, not ours) and fails on any comparison (``==``, ``!=``, ``in``,
``not in``, ``match``/``case``, ``startswith``/``endswith``) against a model-type string: a builtin
model type in any spelling (``"kimi_k3"``, ``"Kimi-K3"``), or any string compared with a ``model_type``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from modelopt_k3.spec import builtin_model_packages

PACKAGE = Path(__file__).resolve().parents[2] / "modelopt_k3"


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def _literals(node: ast.AST):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for elt in node.elts:
            yield from _literals(elt)


def _mentions_model_type(node: ast.AST) -> bool:
    """``x.model_type``, ``model_type``, ``cfg["model_type"]``, ``cfg.get("model_type")``, ``str(...)`` of them."""
    if isinstance(node, ast.Name):
        return node.id == "model_type"
    if isinstance(node, ast.Attribute):
        return node.attr == "model_type"
    if isinstance(node, ast.Subscript):
        return any(v == "model_type" for v in _literals(node.slice))
    if isinstance(node, ast.Call):
        return any(v == "model_type" for a in node.args for v in _literals(a)) or any(
            _mentions_model_type(a) for a in node.args)
    return False


def _compared(node: ast.AST) -> list[list[ast.AST]]:
    """The operand groups a node compares: one list per comparison it makes."""
    if isinstance(node, ast.Compare) and any(
            isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
        return [[node.left, *node.comparators]]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
            "startswith", "endswith"):
        return [[node.func.value, *node.args]]
    if isinstance(node, ast.Match):
        return [[node.subject, *(p.value for c in node.cases for p in ast.walk(c.pattern)
                                 if isinstance(p, ast.MatchValue))]]
    return []


def model_type_comparisons(root: Path, model_types: list[str]) -> list[str]:
    """``file:line [strings]`` of every comparison against a model type outside ``models/<model>/``."""
    wanted = {_norm(t) for t in model_types}
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if (len(rel) > 2 and rel[0] == "models") or "remote_code" in rel:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for sides in _compared(node):
                strings = [v for side in sides for v in _literals(side)]
                by_name = [v for v in strings if any(w in _norm(v) for w in wanted)]
                by_field = [v for v in strings if v and v != "model_type"] if any(
                    _mentions_model_type(s) for s in sides) else []
                if by_name or by_field:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {sorted(set(by_name + by_field))}")
    return found


def test_no_model_type_comparisons_outside_the_model_packages():
    assert model_type_comparisons(PACKAGE, list(builtin_model_packages())) == []


def test_the_scan_finds_each_kind_of_model_branch(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "models" / "kimi_k3").mkdir(parents=True)
    (pkg / "models" / "kimi_k3" / "m.py").write_text('def ok(t):\n    return t == "kimi_k3"\n')  # its own package
    (pkg / "m.py").write_text(
        "def f(spec, raw, name):\n"
        '    a = spec.model_type == "kimi_k3"\n'  # a model type, compared with model_type
        '    b = raw.get("model_type") in ("qwen3_moe", "gpt_oss")\n'  # any string vs model_type
        '    c = name != "Kimi-K3"\n'  # another spelling of a builtin model type
        '    d = name.startswith("kimi_k3.")\n'
        '    match str(raw["model_type"]):\n'
        '        case "gpt_oss":\n'
        "            pass\n"
        '    return raw.get("model_type", "") and a and b and c and d\n'
    )
    found = model_type_comparisons(pkg, ["kimi_k3"])
    assert sorted(f.split()[0] for f in found) == ["pkg/m.py:2", "pkg/m.py:3", "pkg/m.py:4", "pkg/m.py:5", "pkg/m.py:6"], found
