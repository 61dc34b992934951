"""Graph breaks and frame skips: why capture stopped, where, and what the user can read about it.

A *graph break* ends the current graph at a user line: the generated code runs the graph so far,
performs the step natively, and continues in a resume function that is captured in turn. A
*skip* gives up on a whole frame (it runs as its original code); both carry a reason enum and
the user's source line, and both are listed by ``kiln.explain``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kiln.errors import KilnError, SourceLocation


class BreakReason(enum.Enum):
    UNSUPPORTED_BYTECODE = "unsupported bytecode"
    UNSUPPORTED_CALL = "call to a function capture cannot model"
    DATA_DEPENDENT = "data-dependent control flow or value"
    IO = "printing, logging or I/O"
    EXPLICIT = "kiln.graph_break()"
    INLINE_DEPTH = "call nesting too deep to inline"


class SkipReason(enum.Enum):
    BREAK_IN_TRY = "graph break inside try"
    BREAK_IN_LOOP = "graph break inside a loop body"
    BREAK_IN_WITH = "graph break inside a with block of an unknown context manager"
    GENERATOR = "generator or coroutine frame"
    RECOMPILE_LIMIT = "recompile limit reached"
    UNRECONSTRUCTIBLE = "a live value cannot be re-created after the graph"
    INTERNAL_ERROR = "internal capture error"
    BACKEND_ERROR = "backend failed to compile the graph"
    ALIASED_MUTATION = "an input written in place shares memory with another input"
    ITERATOR_ARGUMENT = "an argument is an iterator, which capture would use up"
    RESUMED_UNCOMPILED = (
        "the rest of the frame after a break at an instruction capture cannot resume after"
    )


@dataclass(frozen=True)
class BreakRecord:
    """One graph break or skip, as explain() reports it."""

    reason: BreakReason | SkipReason
    detail: str
    location: SourceLocation | None
    function: str

    def __str__(self) -> str:
        where = f" at {self.location}" if self.location else ""
        return f"{self.reason.name} in {self.function}{where}: {self.detail}"


class GraphBreak(Exception):
    """Raised inside the symbolic interpreter where capture cannot continue."""

    def __init__(
        self, reason: BreakReason, detail: str, location: SourceLocation | None = None
    ) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
        self.location = location


class FullGraphError(KilnError):
    """``fullgraph=True`` and the capture needed a graph break (or skipped the frame)."""
