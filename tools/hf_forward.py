#!/usr/bin/env python
"""Run megatron_glm5's GLM-5.3 model on an HF checkpoint and write its logits.

The command line of :mod:`megatron_glm5.cli.hf_forward` (``--help`` for the options). Needs the package importable
(``pip install -e .`` as scripts/quickstart.sh does, or ``PYTHONPATH`` set to the checkout).
"""

import sys

from megatron_glm5.cli.hf_forward import main

if __name__ == "__main__":
    sys.exit(main())
