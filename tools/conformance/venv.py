"""One virtual environment per engine version, outside every repository, built once and reused.

``<venv_root>/<engine>-<version>`` (default root ``~/.cache/modelopt_k3/engines``) holds the engine's
PyPI release as its own requirements resolve it (CUDA wheels: they install and import on a CPU-only
machine; several GB each). A venv counts as ready only once ``pip install`` finished and wrote the
stamp file, so an interrupted install is redone, not trusted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROOT = Path(os.environ.get("MODELOPT_K3_ENGINES", Path.home() / ".cache" / "modelopt_k3" / "engines"))
STAMP = "modelopt_k3_engine_ready"
DISTRIBUTIONS = {"sglang": "sglang", "vllm": "vllm"}


@dataclass(frozen=True)
class EngineSpec:
    name: str
    version: str

    @classmethod
    def parse(cls, text: str) -> EngineSpec:
        name, sep, version = text.partition("==")
        if not sep or name not in DISTRIBUTIONS or not version or any(c.isspace() or c in "=<>!,;" for c in version):
            raise ValueError(f"--engine {text!r}: expected one of {sorted(DISTRIBUTIONS)} as NAME==VERSION")
        return cls(name, version)

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"

    def venv(self, root: Path) -> Path:
        return root / f"{self.name}-{self.version}"


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


# pip output lines worth a progress line (the rest goes to install.log only).
PROGRESS_PREFIXES = ("Collecting ", "Downloading ", "Installing collected packages", "Successfully installed",
                     "ERROR", "error:")


def install_env(pip_constraint: str | None, say=print) -> dict[str, str]:
    """The environment pip runs in: the caller's, unchanged, unless ``pip_constraint`` is given (a file, or ''
    for none) -- and said either way, since a host constraint pinning a CPU torch breaks an engine install."""
    env = dict(os.environ)
    if pip_constraint is None:
        if env.get("PIP_CONSTRAINT"):
            say(f"note: PIP_CONSTRAINT={env['PIP_CONSTRAINT']} applies to the engine installs "
                "(pass --pip_constraint '' to install without it)")
        return env
    env["PIP_CONSTRAINT"] = pip_constraint
    say(f"engine installs run with PIP_CONSTRAINT={pip_constraint!r} (--pip_constraint)")
    return env


def run_logged(cmd: list[str], log_path: Path, env: dict[str, str], *, label: str, say=print) -> None:
    """Run ``cmd``, its output into ``log_path``; progress lines (``PROGRESS_PREFIXES``) also to ``say``."""
    with open(log_path, "w") as log, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                      text=True, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if line.lstrip().startswith(PROGRESS_PREFIXES):
                say(f"  [{label}] {line.strip()[:160]}")
    if proc.returncode:
        raise RuntimeError(f"{label}: {' '.join(cmd[-3:])} exited {proc.returncode}; its output: {log_path}")


def ensure_venv(spec: EngineSpec, root: Path = DEFAULT_ROOT, *, say=print, pip_constraint: str | None = None) -> Path:
    """The ready venv of ``spec`` under ``root``, created and installed when missing (network: PyPI)."""
    venv = spec.venv(root)
    if (venv / STAMP).exists():
        say(f"[{spec}] using {venv}")
        return venv
    root.mkdir(parents=True, exist_ok=True)
    if not python_of(venv).exists():
        say(f"creating {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    say(f"installing {spec} into {venv} (CUDA wheels, several GB, often 10+ minutes; log: {venv}/install.log)")
    run_logged([str(python_of(venv)), "-m", "pip", "install", f"{DISTRIBUTIONS[spec.name]}=={spec.version}"],
               venv / "install.log", install_env(pip_constraint, say), label=str(spec), say=say)
    (venv / STAMP).write_text(f"{spec}\n")
    return venv


def installed_version(venv: Path, distribution: str) -> str:
    out = subprocess.run([str(python_of(venv)), "-c",
                          f"import importlib.metadata as m; print(m.version({distribution!r}))"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def driver_stub(venv: Path) -> Path:
    """A directory holding ``libcuda.so.1``: every GPU-driver entry point the venv's compiled
    extensions import, each returning CUDA_ERROR_NO_DEVICE (100).

    The engines' extensions link the driver library, which a CPU-only machine lacks, so without it
    they do not load and register none of their (host-side) ops; with it they load, and any call that
    would reach a GPU fails as on a machine without one. Built once per venv with the system ``nm``
    and ``gcc``; the C source is generated here from the symbol list (no third-party code).
    """
    out = venv / "modelopt_k3_no_gpu_driver"
    lib = out / "libcuda.so.1"
    if lib.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    symbols: set[str] = set()
    for so in venv.rglob("*.so*"):
        if not so.is_file():
            continue
        proc = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True, text=True)
        symbols.update(line.split()[-1].split("@")[0] for line in proc.stdout.splitlines()
                       if line.split() and line.split()[-1].startswith("cu") and line.split()[-1][2:3].isupper())
    source = out / "libcuda_stub.c"
    source.write_text("".join(f"int {s}(void) {{ return 100; }}\n" for s in sorted(symbols)))
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
    return out
