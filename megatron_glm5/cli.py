"""Command-line conventions shared by the tools and the training script: bad input is one line, exit 2."""

from __future__ import annotations

import argparse
import sys


def one_line(e: BaseException) -> str:
    """An exception's message on one line (its type name when it has none)."""
    return " ".join(str(e).split()) or type(e).__name__


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one ``PROG: error: ...`` line and exits 2 (no usage dump)."""

    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)
