"""Engine-in-the-loop conformance: the engines' own Kimi-K3 loaders, run on CPU, against the check.

``python -m modelopt_k3.check.conformance`` builds the matrix's exports (``matrix.py``), makes one venv
per pinned engine release (``venv.py``; cached outside the repository), and in each venv runs a driver
(``drivers/<engine>_k3.py``: our own code that imports the engine and drives its public model config,
model loader and model class; the GPU-only pieces it stubs are ``drivers/stub_list.py``). It writes the
observed verdicts next to ``modelopt-k3-check``'s into ``tests/data/engine_conformance.json`` and
``docs/ENGINE_CONFORMANCE.md``; ``tests/check/test_conformance_matrix.py`` compares the check with that
file without any engine installed. A new engine release is one edit of ``PINNED`` and one run.
"""

PINNED = ("sglang==0.5.23", "vllm==0.33.0")
