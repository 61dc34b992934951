"""Command-line plumbing shared by ``kiln`` and its ``bench`` subcommands: a usage error is one
line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import argparse
from typing import NoReturn


class UsageError(Exception):
    """Bad input to a ``kiln`` command: reported as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``kiln bench: error: ...``), without
    the usage block argparse prints first."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")
