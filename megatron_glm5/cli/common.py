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
import os
import sys
from typing import Callable, Optional

from megatron_glm5.errors import CheckpointError, Glm5ConfigError, one_line, quiet_library_warnings  # noqa: F401 (the tools take it from here)

TRACEBACK_ENV = "MEGATRON_GLM5_TRACEBACK"


class OneLineArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would also print the usage)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def stderr_line(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_cli(prog: str, body: Callable[[], Optional[int]], lean: bool = False) -> int:
    """Run ``body`` and turn its exceptions into one stderr line and an exit code (a Ctrl-C while torch is still
    being imported included). ``lean``: a tool that runs no model code imports megatron-core without its compiled
    fusions (:mod:`megatron_glm5.lean_import`, seconds less start-up)."""

    def fail(msg: str, code: int) -> int:
        print(f"{prog}: error: {' '.join(str(msg).split())}", file=sys.stderr, flush=True)
        return code

    user_errors = (CheckpointError, Glm5ConfigError)
    try:
        # torch and megatron-core load here, inside the handler (seconds): a Ctrl-C in them is the one line below
        if lean:
            from megatron_glm5.lean_import import import_megatron_without_compile

            import_megatron_without_compile()
        import megatron_glm5.config  # noqa: F401

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
