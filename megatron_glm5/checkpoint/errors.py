"""The one base class of the errors a user can cause with a checkpoint or its tools.

Every tool prints such an error as one line ``PROG: error: MESSAGE`` and exits 2; messages name the file or field
and the reason, on one line.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """Bad input or an unusable output location (one-line message, exit 2 in the tools)."""


def one_line(e: BaseException, limit: int = 800) -> str:
    """``e`` as one line: whitespace collapsed, an OSError as ``path: reason``, at most ``limit`` characters."""
    if isinstance(e, OSError) and e.strerror:
        where = e.filename if e.filename is not None else ""
        msg = f"{where}: {e.strerror}" if where != "" else e.strerror
        if e.filename2 is not None:
            msg += f" ({e.filename2})"
    else:
        msg = str(e)
    msg = " ".join(msg.split()) or type(e).__name__
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."
