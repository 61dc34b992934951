"""Kiln's exceptions.

Every error Kiln raises about a user's program names the op and the user's source line. Where
eager PyTorch raises a particular exception type for the same mistake (``RuntimeError`` for a
shape mismatch, ``TypeError`` for a bad argument type), Kiln's exception derives from that type
too, so ``except RuntimeError`` code keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceLocation:
    """A line of user code: ``model.py:12`` plus the line's text when it can be read."""

    file: str
    line: int
    text: str = ""

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}"
        return f"{where}: {self.text.strip()}" if self.text else where


class KilnError(Exception):
    """Base class of every Kiln error."""

    def __init__(self, message: str, location: SourceLocation | None = None) -> None:
        self.message = message
        self.location = location
        super().__init__(f"{message}\n  at {location}" if location else message)


class TraceError(KilnError):
    """Tracing could not follow the program (data-dependent control flow, an unsupported call)."""


class OpaqueCallError(TraceError):
    """A torch call a graph cannot hold as a node: it writes to an operand in place, returns
    Python values, or cannot run on tensors without data. Bytecode capture runs it natively
    (a graph break at the call); symbolic tracing stops there."""


class OpError(KilnError, RuntimeError):
    """An op was given inputs eager PyTorch rejects at run time (shape mismatch, bad index)."""


class OpTypeError(KilnError, TypeError):
    """An op was given an argument of a type or dtype it does not accept."""


class OpNotImplementedError(KilnError, NotImplementedError):
    """An op does not support a dtype (eager's "not implemented for 'Float'")."""


class OpIndexError(KilnError, IndexError):
    """An op was given a dim or index out of range."""


class IndexOutOfBounds(OpIndexError, RuntimeError):
    """A kernel read through an index outside its dimension (eager raises IndexError for
    ``x[i]``, ``index_select`` and ``embedding``, RuntimeError for ``gather``: both catch it)."""

    @classmethod
    def of(cls, index: int, size: int) -> IndexOutOfBounds:
        return cls(f"index {index} is out of bounds for a dimension of size {size}")


class OpValueError(KilnError, ValueError):
    """An op was given an argument value it does not accept."""


class VerificationError(KilnError):
    """A graph broke an IR invariant: a pass or frontend produced an invalid graph."""


class BackendError(KilnError):
    """A backend failed to compile or run a graph."""


class CompilerNotFoundError(BackendError):
    """No C++ compiler is on PATH: C++ kernels cannot be built on this machine."""


class KernelBuildError(BackendError):
    """The C++ compiler rejected generated source (the message names the file and shows the
    compiler's output)."""


def op_error(message: str, error: Exception, location: SourceLocation | None) -> KilnError:
    """The Kiln error for an op that failed with ``error``: the same builtin type eager raises
    (``RuntimeError``, ``TypeError``, ``IndexError``...), with ``message`` and the user's line."""
    for builtin, kind in (
        (NotImplementedError, OpNotImplementedError),
        (IndexError, OpIndexError),
        (TypeError, OpTypeError),
        (ValueError, OpValueError),
    ):
        if isinstance(error, builtin):
            return kind(message, location)
    return OpError(message, location)
