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


# Set by bytecode capture, whose user frames are interpreted, not real Python frames.
_current: list[SourceLocation | None] = [None]


def set_user_location(location: SourceLocation | None) -> SourceLocation | None:
    """Make ``user_location()`` answer ``location`` (None: look at Python frames again); returns
    the previous setting so callers can restore it."""
    previous = _current[0]
    _current[0] = location
    return previous


def user_location() -> SourceLocation | None:
    """Where the user's code is now: file, line and the line's text; None if only internals run."""
    if _current[0] is not None:
        return _current[0]
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_internal(os.path.abspath(filename)):
            line = frame.f_lineno or 0
            return SourceLocation(filename, line, linecache.getline(filename, line).strip())
        frame = frame.f_back  # type: ignore[assignment]
    return None
