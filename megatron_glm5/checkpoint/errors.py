"""The checkpoint tools' error names; they live in :mod:`megatron_glm5.errors`.

Every tool prints such an error as one line ``PROG: error: MESSAGE`` and exits 2; messages name the file or field
and the reason, on one line.
"""

from megatron_glm5.errors import CheckpointError, one_line

__all__ = ["CheckpointError", "one_line"]
