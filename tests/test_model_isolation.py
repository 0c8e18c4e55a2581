"""No model package imports another (issue 39): what two models share lives in ``models/common``, which imports
no model package either; and ``common`` is no model type."""

from __future__ import annotations

from pathlib import Path

from test_import_layers import imports_of

from modelopt_k3.spec import builtin_model_packages

MODELS = Path(__file__).resolve().parents[1] / "modelopt_k3" / "models"
PREFIX = "modelopt_k3.models."


def _package_of(module: str) -> str | None:
    return module[len(PREFIX):].split(".")[0] if module.startswith(PREFIX) else None


def cross_model_imports() -> list[str]:
    found = []
    for path in sorted(MODELS.rglob("*.py")):
        own = path.relative_to(MODELS).parts[0]
        if own.endswith(".py"):
            continue
        for module in imports_of(path):
            other = _package_of(module)
            if other is not None and other != own and (other != "common" or own == "common"):
                found.append(f"{path.relative_to(MODELS)} imports {module}")
    return found


def test_no_model_package_imports_another():
    assert cross_model_imports() == []


def test_the_scan_sees_a_cross_model_import(tmp_path, monkeypatch):
    # The rule goes red on the arrow this issue removed (deepseek_v3 -> qwen3_moe's experts).
    bad = MODELS / "deepseek_v3" / "_isolation_probe.py"
    bad.write_text("from ..qwen3_moe import QWEN3_MOE_SPEC\n")
    try:
        assert cross_model_imports() == ["deepseek_v3/_isolation_probe.py imports modelopt_k3.models.qwen3_moe"]
    finally:
        bad.unlink()


def test_common_is_no_model_type():
    assert "common" not in builtin_model_packages()
    assert {"deepseek_v3", "gpt_oss", "kimi_k3", "qwen3_moe"} <= set(builtin_model_packages())
