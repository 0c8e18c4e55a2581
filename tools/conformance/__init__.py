"""Engine-in-the-loop conformance: the engines' own loaders of every model here, run on CPU, against the check.

A developer tool run from a checkout, not part of the installed library (it builds test checkpoints and
calls ``modelopt_k3.cli.hf_ptq``): ``python -m tools.conformance`` validates its arguments, builds the
matrix's exports (``matrix.py``), makes one venv per pinned engine release (``venv.py``; cached outside the
repository), and in each venv runs a driver (``drivers/<engine>_<model>.py``, by the export's ``model_type``: our own code that imports the engine
and drives its public model config, model loader and model class; the GPU-only pieces it stubs are
``drivers/stub_list.py``). It writes the observed verdicts next to ``modelopt-k3-check``'s into ``--out``
(``engine_conformance.json``, ``ENGINE_CONFORMANCE.md``) and exits 1 on any disagreement; with
``--update_committed`` it also regenerates ``tests/data/engine_conformance.json`` and
``docs/ENGINE_CONFORMANCE.md``, which ``tests/check/test_conformance_matrix.py`` compares the check with, without
any engine installed. A new engine release is one edit of ``PINNED`` and one run.

TensorRT-LLM (no installable release has Kimi-K3) is replayed instead: ``python -m tools.conformance.trtllm
--trtllm_src DIR`` runs its own Kimi-K3 quantization/name-resolution functions from a TensorRT-LLM source tree
(``trtllm.py``; pinned per definition) over the same exports, and writes its rows beside the engines'.
"""

PINNED = ("sglang==0.5.23", "vllm==0.33.0")
