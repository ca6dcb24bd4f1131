#!/usr/bin/env python
"""Convert an HF GLM-5.3 checkpoint (FP8 or BF16 safetensors) into a megatron-core torch_dist checkpoint.

The command line of :mod:`megatron_glm5.cli.convert_hf_to_mcore` (``--help`` for the options). Needs the package importable
(``pip install -e .`` as scripts/quickstart.sh does, or ``PYTHONPATH`` set to the checkout).
"""

import sys

from megatron_glm5.cli.convert_hf_to_mcore import main

if __name__ == "__main__":
    sys.exit(main())
