"""Thin wrapper: ``python examples/hf_ptq.py ...`` or ``torchrun --nproc_per_node N examples/hf_ptq.py ...``.

The implementation is ``modelopt_k3.cli.hf_ptq`` (also installed as ``modelopt-k3-ptq``).
"""

import sys

from modelopt_k3.cli.hf_ptq import main

if __name__ == "__main__":
    sys.exit(main())
