#!/usr/bin/env python
"""Tokenize a JSONL file into megatron-core indexed datasets (``PREFIX_KEY_document.bin`` / ``.idx``).

The command line of :mod:`megatron_glm5.cli.preprocess_data` (``--help`` for the options). Needs the package importable
(``pip install -e .`` as scripts/quickstart.sh does, or ``PYTHONPATH`` set to the checkout).
"""

import sys

from megatron_glm5.cli.preprocess_data import main

if __name__ == "__main__":
    sys.exit(main())
