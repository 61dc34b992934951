"""What compiling made, as events for whoever listens: ``kiln.explain``, ``kiln explain``,
tests and benchmarks.

Capture records each capture and each frame it runs uncompiled (``Captured``), the backend
each program it compiles (``CompiledProgramRecord``). Nobody listening costs one empty loop::

    with recording(CompiledProgramRecord) as programs:
        compiled(x)
    programs[-1].program.kernels()
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_LISTENERS: list[tuple[tuple[type, ...], list[Any]]] = []
_LOCK = threading.Lock()


def record(event: object) -> None:
    """Hand ``event`` to every listener that wants its kind."""
    for kinds, events in tuple(_LISTENERS):  # (a snapshot: another thread may unlisten)
        if not kinds or isinstance(event, kinds):
            events.append(event)


def listen(events: list[Any], *kinds: type) -> None:
    """Append the events of ``kinds`` (every event when none are named) to ``events`` until
    :func:`unlisten`."""
    with _LOCK:
        _LISTENERS.append((kinds, events))


def unlisten(events: list[Any]) -> None:
    with _LOCK:
        _LISTENERS[:] = [(k, e) for k, e in _LISTENERS if e is not events]


@contextmanager
def recording(*kinds: type) -> Iterator[list[Any]]:
    """The events of ``kinds`` (every event when none are named) recorded inside the block."""
    events: list[Any] = []
    listen(events, *kinds)
    try:
        yield events
    finally:
        unlisten(events)


# Objects that report a state which changes after compiling (a CUDA graph that records on its
# second call): ``kiln.explain()`` of everything compiled so far reads them as they are now.
_LIVE: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def keep_live(report: object) -> None:
    """Make ``report`` readable by :func:`live` for as long as it exists."""
    _LIVE[id(report)] = report


def live() -> list[Any]:
    return list(_LIVE.values())
