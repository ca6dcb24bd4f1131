"""The command-line tools (``tools/*.py`` call these modules' ``main``) and their shared conventions: a bad
command line or bad input is one ``PROG: error: ...`` line and exit 2 (:mod:`megatron_glm5.cli.common`)."""

from megatron_glm5.errors import one_line
from megatron_glm5.cli.common import OneLineArgumentParser, run_cli

__all__ = ["OneLineArgumentParser", "one_line", "run_cli"]
