#!/usr/bin/env python
"""Write a tiny generated data set for CPU runs, examples and tests (no download).

The command line of :mod:`megatron_glm5.cli.make_tiny_data` (``--help`` for the options). Needs the package importable
(``pip install -e .`` as scripts/quickstart.sh does, or ``PYTHONPATH`` set to the checkout).
"""

import sys

from megatron_glm5.cli.make_tiny_data import main

if __name__ == "__main__":
    sys.exit(main())
