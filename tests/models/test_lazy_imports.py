"""A spec is read without importing what only a built model needs (``models/common/lazy.py``).

transformers' modeling modules import its experts interface and masking utilities and with them torch's compiler
stack (~1 s); convert, check and plan read a spec's regexes, recipes and rules and build no model, so building a
spec and reading those fields import none of them. Each case runs in a fresh interpreter: this one has them all.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from modelopt_k3.spec.registry import builtin_model_packages

ROOT = Path(__file__).resolve().parents[2]
MODELS = sorted(builtin_model_packages())
# What a spec's reader must not import: transformers' experts interface, torch's compiler, any modeling module.
HEAVY = "('torch._dynamo', 'transformers.integrations.moe')"
HEAVY_CHECK = (
    "import re, sys\n"
    f"loaded = sorted(m for m in sys.modules if m in {HEAVY} "
    "or re.fullmatch(r'transformers\\.models\\.\\w+\\.modeling_\\w+', m))\n"
    "assert not loaded, loaded\n"
)


def _run(script: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("model_type", MODELS)
def test_reading_a_spec_imports_no_modeling_module(model_type):
    _run(
        "from modelopt_k3.spec import get_spec\n"
        f"spec = get_spec({model_type!r})\n"
        "assert spec.experts.key_regex and spec.experts.projections and spec.recipes is not None\n"
        "assert spec.serving is not None and spec.source_check is not None\n"
        + HEAVY_CHECK
    )


@pytest.mark.parametrize("package, names", [
    ("deepseek_v3", ["DeepseekV3FusedExperts"]),
    ("qwen3_moe", ["Qwen3MoeFusedExperts"]),
    ("qwen3_5_moe", ["Qwen3_5MoeFusedExperts"]),
    ("gpt_oss", ["FusedGptOssForCausalLM", "GptOssFusedExperts"]),
    ("nemotron_h", ["NemotronHBackboneForCausalLM", "NemotronHFusedExperts"]),
    ("minimax_m2", ["MiniMaxM2HubForCausalLM"]),
])
def test_a_packages_classes_are_importable_when_asked(package, names):
    """The public names made lazy are still imported by name, each the one class (``lazy_attrs`` keeps it)."""
    _run(
        f"import modelopt_k3.models.{package} as pkg\n"
        f"from modelopt_k3.models.{package} import {', '.join(names)}\n"
        f"assert all(isinstance(c, type) and getattr(pkg, c.__name__) is c for c in ({', '.join(names)},))\n"
        "import transformers.integrations.moe  # now imported, as on a build\n"
    )


def test_the_deepseek_v3_converter_imports_transformers_modeling_only_to_build_a_model(tmp_path):
    """The converter CLI on the DeepSeek-V3 stand-in: transformers' experts interface (and torch's compiler
    with it) is first imported where the model class is resolved for a build (the source decode's converters,
    the shared-input probe, the final check's meta model), never while the spec is read. Those builds need the
    class, so unlike Kimi-K3's (remote code, no model built) this run still imports it, once."""
    from modelopt_k3.testing import make_tiny

    src = make_tiny("deepseek_v3", tmp_path / "src")
    _run(
        "import sys, traceback\n"
        "first = {}\n"
        "class Watch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'transformers.integrations.moe' and not first:\n"
        "            first['stack'] = [(f.filename, f.name) for f in traceback.extract_stack()]\n"
        "sys.meta_path.insert(0, Watch())\n"
        "from modelopt_k3.cli.convert import main\n"
        f"code = main(['--src', {str(src)!r}, '--dst', {str(tmp_path / 'out')!r}, '--no_progress'])\n"
        "assert code == 0, code\n"
        "stack = first['stack']\n"
        "assert any(f.endswith('modelopt_k3/spec/contract.py') and n == 'resolve' for f, n in stack), stack\n"
        "assert not any('/modelopt_k3/models/' in f and n == '<module>' for f, n in stack), stack\n"
    )


@pytest.mark.parametrize("model_type", ["deepseek_v3", "kimi_k3"])
def test_the_plan_cli_imports_no_modeling_module(model_type, tmp_path):
    """modelopt-k3-plan reads headers and a spec: none of the ~1 s of imports above (it took 3.2 s on the
    DeepSeek-V3 stand-in, 2.2 s without them); its eager experts need no registry look-up. (A model whose source
    layout is read off its class built on meta, ``meta_layouts``: Qwen3-MoE, GLM-5, ..., imports its modeling
    module there: the build needs the class.)"""
    from modelopt_k3.testing import make_tiny

    src = make_tiny(model_type, tmp_path / "src")
    _run(
        "from modelopt_k3.cli.plan import main\n"
        "try:\n"
        f"    main(['--pyt_ckpt_path', {str(src)!r}, '--world_size', '2', '--device', 'cpu', '--gpu_mem_gib', '8',"
        " '--time'])\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        + HEAVY_CHECK
    )
