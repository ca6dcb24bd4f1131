#!/usr/bin/env python
"""Write a tiny random GLM-5.3 checkpoint in the released HF layout, for tests and the CPU quickstart.

The command line of :mod:`megatron_glm5.cli.make_tiny_hf_checkpoint` (``--help`` for the options). Needs the package importable
(``pip install -e .`` as scripts/quickstart.sh does, or ``PYTHONPATH`` set to the checkout).
"""

import sys

from megatron_glm5.cli.make_tiny_hf_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
