#!/usr/bin/env python
"""Export a megatron-core torch_dist checkpoint of GLM-5.3 to an HF checkpoint that transformers loads.

The command line of :mod:`megatron_glm5.cli.convert_mcore_to_hf` (``--help`` for the options). Needs the package importable
(``pip install -e .`` as scripts/quickstart.sh does, or ``PYTHONPATH`` set to the checkout).
"""

import sys

from megatron_glm5.cli.convert_mcore_to_hf import main

if __name__ == "__main__":
    sys.exit(main())
