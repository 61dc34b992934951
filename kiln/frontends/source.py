"""Find the user's source line: the innermost frame outside Kiln and PyTorch."""

from __future__ import annotations

import linecache
import os
import sys

import torch

from kiln.errors import SourceLocation

_INTERNAL = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def is_internal(filename: str) -> bool:
    return filename.startswith(_INTERNAL) or filename.startswith("<frozen")


def user_location() -> SourceLocation | None:
    """Where the user's code is now: file, line and the line's text; None if only internals run."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_internal(os.path.abspath(filename)):
            line = frame.f_lineno or 0
            return SourceLocation(filename, line, linecache.getline(filename, line).strip())
        frame = frame.f_back  # type: ignore[assignment]
    return None
