"""A regular (non-editable) install works: the wheel carries every module, and its commands run from
outside the repository on each model's tiny stand-in (issue 27: a hand-written package list left
modelopt_k3.spec and two model packages out of the wheel, hidden by editable installs).

The wheel is built from this checkout without build isolation (no network) and installed with
``pip install --target`` into a fresh directory; the subprocesses put only that directory ahead of
site-packages, so they import the wheel's copy (asserted), never the checkout's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# Every module of the package, imported from the installed copy; it prints where the package came from.
IMPORT_ALL = """
import importlib, pkgutil, sys
# The stand-in's hub files: transformers imports them as a checkpoint's own code.
SCRIPTS = ("modelopt_k3.testing.remote_code.",)
import modelopt_k3
failed = []
for info in pkgutil.walk_packages(modelopt_k3.__path__, "modelopt_k3."):
    if info.name.startswith(SCRIPTS) or info.name.endswith(".__main__"):
        continue  # files run, not imported: entry points and hub files
    try:
        importlib.import_module(info.name)
    except Exception as exc:
        failed.append(f"{info.name}: {type(exc).__name__}: {exc}")
print(modelopt_k3.__file__)
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""

MAKE_STANDINS = """
import sys
from modelopt_k3.testing.qwen3_moe import make_tiny_qwen3_moe
from modelopt_k3.testing.tiny_gpt_oss import make_tiny_gpt_oss
make_tiny_qwen3_moe(sys.argv[1])
make_tiny_gpt_oss(sys.argv[2])
"""


_ANYWHERE = shutil.ignore_patterns(".git", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache")
_AT_ROOT = {"build", "dist", "_work"}  # setuptools' and the tools' output: only at the top (modelopt_k3/dist is a package)


def _not_copied(directory: str, names: list[str]) -> set[str]:
    ignored = set(_ANYWHERE(directory, names))
    if Path(directory) == REPO:
        ignored |= {n for n in names if n in _AT_ROOT or n.startswith("out")}
    return ignored


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel of this checkout, installed into a fresh --target directory."""
    root = tmp_path_factory.mktemp("wheel")
    source, wheel_dir, target = root / "source", root / "wheel", root / "site"
    # Built from a copy: setuptools writes build/ into the source tree, and stale files there would
    # reach later wheels (and hide a missing package).
    shutil.copytree(REPO, source, ignore=_not_copied)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheel_dir),
         str(source)], capture_output=True, text=True, timeout=300, cwd=root)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = wheel_dir.glob("modelopt_k3-*.whl")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=300, cwd=root)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    return target


def _run(target: Path, cwd: Path, argv: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(target), MODELOPT_K3_CACHE=str(cwd / "cache"), OMP_NUM_THREADS="1")
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{argv}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def _script(target: Path, name: str) -> list[str]:
    # The console script pip wrote, run by this interpreter (its shebang names the same one).
    return [sys.executable, str(target / "bin" / name)]


def test_wheel_imports_every_module_from_the_install(installed, tmp_path):
    proc = _run(installed, tmp_path, [sys.executable, "-c", IMPORT_ALL])
    assert Path(proc.stdout.splitlines()[0]).resolve().is_relative_to(installed.resolve())
    recipes = installed / "modelopt_k3" / "recipes"
    assert (recipes / "presets" / "nvfp4.yaml").is_file()
    assert (recipes / "models" / "moonshotai" / "Kimi-K3" / "nvfp4_experts.yaml").is_file()


def _check_export(out: Path) -> None:
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index and all((out / f).is_file() for f in set(index.values()))
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] in {"modelopt", "modelopt_mixed"}


def test_wheel_commands_run_every_model_outside_the_repo(installed, tmp_path):
    qwen, gpt_oss = tmp_path / "qwen3_moe", tmp_path / "gpt_oss"
    _run(installed, tmp_path, [sys.executable, "-c", MAKE_STANDINS, str(qwen), str(gpt_oss)])
    ptq = _script(installed, "modelopt-k3-ptq")
    convert = _script(installed, "modelopt-k3-convert")
    # Kimi-K3: the embedded stand-in (generated into MODELOPT_K3_CACHE by the installed package).
    runs = {
        "kimi": (None, ["--trust_remote_code"], []),
        "qwen": (qwen, [], ["--recipe", "w4a16_nvfp4"]),
        "gpt_oss": (gpt_oss, [], []),
    }
    for name, (ckpt, ptq_flags, convert_flags) in runs.items():
        src = ["--pyt_ckpt_path", str(ckpt)] if ckpt else []
        out = tmp_path / f"{name}-ptq"
        _run(installed, tmp_path, [*ptq, *src, *ptq_flags, "--qformat", "nvfp4", "--calib_size", "4",
                                   "--export_path", str(out), "--no_progress"])
        _check_export(out)
        source = ckpt or next((tmp_path / "cache").glob("tiny_kimi_k3-*"))
        converted = tmp_path / f"{name}-convert"
        _run(installed, tmp_path, [*convert, "--src", str(source), "--dst", str(converted), *convert_flags,
                                   *(["--trust_remote_code"] if name == "kimi" else []), "--no_progress"])
        _check_export(converted)
