"""What every tool shares: an argument parser whose errors are one line, and the one place where exceptions become
exit codes.

    def main(argv=None) -> int:
        args = OneLineArgumentParser(prog=PROG, ...).parse_args(argv)
        return run_cli(PROG, lambda: body(args))

Exit 2 with ``PROG: error: <file or field>: <reason>`` for everything a user can cause (bad checkpoints and
configs, refused output paths, missing files, no permission, a full disk); exit 130 on Ctrl-C; any other exception
is an internal error: one line, exit 1 (``MEGATRON_GLM5_TRACEBACK=1`` shows its traceback). No traceback reaches
the user otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from typing import Callable, Optional

from megatron_glm5.checkpoint.errors import CheckpointError, one_line

TRACEBACK_ENV = "MEGATRON_GLM5_TRACEBACK"


class OneLineArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would also print the usage)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def stderr_line(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def quiet_library_warnings() -> None:
    """Keep stderr to progress, notices and the error line: megatron warns about missing TE / Apex on import, and
    megatron-core's import of ``torch.utils.cpp_extension`` logs "No CUDA runtime is found" where a CUDA toolkit is
    installed but no GPU is visible (CPU machines, the converter's workers)."""
    for mod in (r"megatron(\..*)?", r"torch(\..*)?", r"transformers(\..*)?"):
        for cat in (UserWarning, FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=cat, module=mod)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def run_cli(prog: str, body: Callable[[], Optional[int]]) -> int:
    """Run ``body`` and turn its exceptions into one stderr line and an exit code (a Ctrl-C while torch is still
    being imported included)."""

    def fail(msg: str, code: int) -> int:
        print(f"{prog}: error: {' '.join(str(msg).split())}", file=sys.stderr, flush=True)
        return code

    user_errors = (CheckpointError,)
    try:
        from megatron_glm5.config import Glm5ConfigError  # imports torch: seconds

        user_errors = (CheckpointError, Glm5ConfigError)
        return body() or 0
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except user_errors as e:
        return fail(one_line(e), 2)
    except OSError as e:  # missing file, no permission, disk full ...
        return fail(one_line(e), 2)
    except MemoryError:
        return fail("out of memory", 2)
    except Exception as e:  # noqa: BLE001 - the last line of defence: never a traceback on the console
        if os.environ.get(TRACEBACK_ENV):
            raise
        return fail(f"internal error: {type(e).__name__}: {one_line(e)} (set {TRACEBACK_ENV}=1 for the traceback)",
                    1)
