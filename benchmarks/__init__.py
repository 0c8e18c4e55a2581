"""modelopt_k3 benchmark suite (issue 6): our hot paths against the ecosystem's own code, as ratios.

Run ``python -m benchmarks`` from the repository root; see ``benchmarks/run.py`` for the flags and
``benchmarks/RESULTS.md`` for the latest committed figures.
"""
