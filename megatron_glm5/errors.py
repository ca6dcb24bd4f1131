"""The errors a user can cause, and how one becomes one line of text (the bottom room: imports nothing of this
package, so data/, checkpoint/, training/, models/ and the CLIs all import it).

Every entry point prints a user error as one line naming the file, flag or field and the reason (``PROG: error:
MESSAGE``) and exits non-zero; no traceback.
"""

from __future__ import annotations

import logging
import warnings


class CheckpointError(ValueError):
    """Bad input or an unusable output location (one-line message, exit 2 in the tools)."""


class Glm5ConfigError(ValueError):
    """An HF config or a Glm5Config field that cannot describe a valid GLM-5.3 model."""


class DataError(ValueError):
    """Bad data input (a missing file, a malformed record, a tokenizer that does not fit the model).

    The message is one line that names the input and the reason; entry points print it and exit 2.
    """


class ArgumentError(ValueError):
    """A bad flag value or combination: the message names the flag and says why."""

    def __init__(self, flag: str, reason: str):
        super().__init__(f"{flag}: {reason}")
        self.flag = flag


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


def quiet_library_warnings() -> None:
    """Keep stderr to progress, notices and the error line: megatron warns about missing TE / Apex on import, and
    megatron-core's import of ``torch.utils.cpp_extension`` logs "No CUDA runtime is found" where a CUDA toolkit is
    installed but no GPU is visible (CPU machines, the converter's workers)."""
    for mod in (r"megatron(\..*)?", r"torch(\..*)?", r"transformers(\..*)?"):
        for cat in (UserWarning, FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=cat, module=mod)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
