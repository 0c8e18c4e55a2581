"""One ``hf_ptq`` run decides once (issue 27): the decision table (``decide``), the distribution plan
(``decide_plan``) and every source shard's header (``read_shard``) are each made once per process, in the
preflight, and handed on in the ``RunPlan``; load, quantize, export, report and the engine check take it.

The functions are wrapped where every module of the package refers to them, so a call through any
import (module-level or lazy) is counted.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SMALL = ["--calib_size", "2", "--batch_size", "2", "--calib_seq", "16", "--no_progress"]


def _count(monkeypatch: pytest.MonkeyPatch, fn, calls: Counter, key) -> None:
    """Replace ``fn`` in every loaded ``modelopt_k3`` module that holds it; each call adds ``key(*args)``."""

    def counted(*args, **kwargs):
        calls[key(*args, **kwargs)] += 1
        return fn(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("modelopt_k3") and module is not None:
            for attr, value in list(vars(module).items()):
                if value is fn:
                    monkeypatch.setattr(module, attr, counted)


def _source_shard(ckpt: Path):
    def key(path, *args, **kwargs):
        path = Path(path).resolve()
        return f"header {path.name}" if path.parent == ckpt.resolve() else "other"

    return key


@pytest.mark.parametrize("extra", [[], ["--target_engines", "vllm", "--experts", "bf16"]],
                         ids=["default", "engines"])
def test_one_hf_ptq_run_decides_each_thing_once(tiny_ckpt, tmp_path, monkeypatch, restore_remote_code, extra):
    import modelopt_k3.check as check
    import modelopt_k3.checkpoint as checkpoint
    import modelopt_k3.cli.hf_ptq as hf_ptq
    import modelopt_k3.dist.plan as dist_plan
    import modelopt_k3.load  # noqa: F401  every module that imports the functions, before they are wrapped
    import modelopt_k3.memory.planner  # noqa: F401
    import modelopt_k3.quant.api  # noqa: F401
    import modelopt_k3.quant.decisions as decisions
    import modelopt_k3.run.preflight  # noqa: F401
    import modelopt_k3.spec.registry as registry

    calls: Counter = Counter()
    _count(monkeypatch, decisions.decide, calls, lambda *a, **k: "decide")
    _count(monkeypatch, dist_plan.decide_plan, calls, lambda *a, **k: "decide_plan")
    _count(monkeypatch, checkpoint.read_shard, calls, _source_shard(tiny_ckpt))
    # The final engine check reads the export as ``modelopt-k3-check`` would, trusting nothing of the run:
    # its own spec lookups (by the export's config.json) are counted apart.
    checking: list[bool] = []
    real_final_check = check.final_check

    def final_check(*args, **kwargs):
        checking.append(True)
        return real_final_check(*args, **kwargs)

    monkeypatch.setattr(check, "final_check", final_check)
    # So does the exporter's serving-rule check of the staged export before publishing (issue 41).
    import modelopt_k3.export.model_export as model_export

    real_refuse = model_export.refuse_unservable

    def refuse_unservable(*args, **kwargs):
        checking.append(True)
        try:
            return real_refuse(*args, **kwargs)
        finally:
            checking.pop()

    monkeypatch.setattr(model_export, "refuse_unservable", refuse_unservable)
    _count(monkeypatch, registry.get_spec, calls, lambda *a, **k: "get_spec (export check)" if checking else "get_spec")
    rc = hf_ptq.main(["--pyt_ckpt_path", str(tiny_ckpt), "--trust_remote_code", "--export_path",
                      str(tmp_path / "out"), *SMALL, *extra])
    assert rc == 0
    assert calls["decide"] == 1 and calls["decide_plan"] == 1 and calls["get_spec"] == 1, calls
    assert checking, "the run never checked its export"
    headers = {k: n for k, n in calls.items() if k.startswith("header ")}
    shards = {p.name for p in tiny_ckpt.glob("*.safetensors")}
    assert set(headers) == {f"header {s}" for s in shards} and set(headers.values()) == {1}, calls
