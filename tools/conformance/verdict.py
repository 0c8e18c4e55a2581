"""A driver's JSON -> the check-vocabulary verdict it amounts to (shared by the runner and the report).

* ``refuses``: the engine raised while building its model from the export's configs, in ``load_weights``, or
  in ``process_weights_after_loading``;
* ``loads but serves different numbers``: it loaded, but an export tensor landed in no parameter byte for byte,
  an engine parameter was never written, or a post-load scale differs from the export's;
* ``loads correctly``: none of those.
"""

from __future__ import annotations

from modelopt_k3.check.report import DIFFERENT, LOADS, REFUSES

# Errors that are the CPU's, not the engine's answer: a CUDA op without a CPU kernel, torch.compile of a
# GPU path, a kernel entry point that did not load, a call that needs the GPU driver, flashinfer asking a
# CPU-placed tensor's device for its compute capability (flashinfer utils.py get_compute_capability).
CPU_LIMITS = ("from the 'CPU' backend", "InternalTorchDynamoError", "'NoneType' object is not callable",
              "Found no NVIDIA driver", "Torch not compiled with CUDA", "device must be a cuda device")


def cpu_limit(error: dict) -> bool:
    return any(s in f"{error.get('type')}: {error.get('message')}" for s in CPU_LIMITS)


def observed_verdict(result: dict) -> str | None:
    """The verdict the engine's behaviour amounts to (None: not observed, because the driver did not get far
    enough or the step needs a GPU)."""
    if result.get("error"):
        if cpu_limit(result["error"]):
            return None
        return REFUSES if result["error"]["stage"] in ("build", "load_weights", "post_process") else None
    if result.get("outcome") != "ran":
        return None
    load = result["load"]
    post = result.get("post_load", {})
    if load["not_landed"] or load["params_never_written"] or post.get("mismatches"):
        return DIFFERENT
    return LOADS
