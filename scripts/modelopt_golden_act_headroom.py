"""Write tests/data/modelopt_0_47_act_headroom_golden.json: nvidia-modelopt 0.47.0's ``NVFP4ActHeadroomCalibrator``
amax on the activation batches ``act_headroom_cases()`` generates (tests/quant/test_act_headroom.py compares ours).

NOT run by the tests and not part of the package (the project never depends on ModelOpt). ModelOpt's package
imports much more than this calibrator needs, so the script runs its two files as they are, from an unpacked wheel
(``pip download nvidia-modelopt==0.47.0 --no-deps``, then unzip), under a stand-in package: ``calib/calibrator.py``
and ``calib/nvfp4_act_headroom.py``, with ``reduce_block_amax`` and what it calls taken from ``utils/core_utils.py`` by name
(their own text). From the repository root:

    PYTHONPATH=$PWD python scripts/modelopt_golden_act_headroom.py UNPACKED_WHEEL_DIR
"""

from __future__ import annotations

import ast
import json
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.quant.test_act_headroom import GOLDEN, act_headroom_cases  # noqa: E402 - the test's own inputs


def _definitions(path: Path, names: tuple[str, ...]) -> dict:
    """Top-level functions and assignments of ``path``, by name, run from their own text (they need only torch)."""
    tree = ast.parse(path.read_text())
    nodes = [n for n in tree.body
             if (isinstance(n, ast.FunctionDef) and n.name in names)
             or (isinstance(n, ast.Assign) and any(getattr(t, "id", None) in names for t in n.targets))]
    namespace = {"torch": torch}
    exec(compile(ast.Module(nodes, []), str(path), "exec"), namespace)
    return namespace


def _modelopt_calibrator(root: Path) -> type:
    """ModelOpt's ``NVFP4ActHeadroomCalibrator`` class, its module and its base's run under a stand-in package."""
    quant = root / "modelopt" / "torch" / "quantization"
    for name in ("mo_q", "mo_q.calib"):
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__path__ = []
    utils = sys.modules["mo_q.utils"] = types.ModuleType("mo_q.utils")
    core = _definitions(quant / "utils" / "core_utils.py", ("_FP8_DTYPES", "reduce_amax", "reduce_block_amax"))
    utils.reduce_block_amax = core["reduce_block_amax"]
    for name in ("calibrator", "nvfp4_act_headroom"):
        module = sys.modules[f"mo_q.calib.{name}"] = types.ModuleType(f"mo_q.calib.{name}")
        module.__package__ = "mo_q.calib"
        exec(compile((quant / "calib" / f"{name}.py").read_text(), f"{name}.py", "exec"), module.__dict__)
    return sys.modules["mo_q.calib.nvfp4_act_headroom"].NVFP4ActHeadroomCalibrator


def main(argv: list[str]) -> int:
    calibrator_cls = _modelopt_calibrator(Path(argv[0]))
    golden = {}
    for name, (batches, options) in act_headroom_cases().items():
        calibrator = calibrator_cls(block_size=16, **options)
        for x in batches:
            calibrator.collect(x)
        golden[name] = {"amax": float(calibrator.compute_amax()).hex(), "options": options}
    GOLDEN.write_text(json.dumps({"modelopt": "0.47.0", "cases": golden}, indent=1) + "\n")
    print(f"wrote {GOLDEN}: {len(golden)} cases")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
