"""The symbolic frame: one Python function activation executed instruction by instruction.

A :class:`Frame` holds the value stack, locals, cells and the instruction pointer of one code
object. :meth:`Frame.run` dispatches each instruction to its handler in ``HANDLERS`` (filled by
``kiln/capture/handlers/``, one function per opcode); calls to Python functions create a child
frame (inlining). Exceptions raised by an instruction go through the code's exception table as
CPython's would, so ``try``/``except``/``with`` work symbolically.

Where capture cannot go on, a handler raises :class:`~kiln.capture.core.breaks.GraphBreak`; it
travels to the root frame, and the driver restarts the capture with the break placed at the
root frame's instruction that was running.
"""

from __future__ import annotations

import dis
import linecache
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.capture.core.breaks import BreakReason, GraphBreak
from kiln.capture.core.session import Session
from kiln.errors import OpaqueCallError, SourceLocation, TraceError
from kiln.frontends.source import set_user_location

PY = sys.version_info[:2]
MAX_INLINE_DEPTH = 40


class _Null:
    """CPython's NULL stack slot (pushed before a callable that is not a method)."""

    def __repr__(self) -> str:
        return "NULL"


NULL = _Null()
UNBOUND = object()  # a local that has no value


@dataclass(frozen=True)
class ExceptionEntry:
    start: int
    end: int
    target: int
    depth: int
    lasti: bool


def exception_table(code: types.CodeType) -> list[ExceptionEntry]:
    """The code's exception table (byte offsets, ``end`` exclusive)."""
    parse = getattr(dis, "_parse_exception_table", None)
    if parse is None:  # pragma: no cover - every supported version has it
        return []
    return [ExceptionEntry(e.start, e.end, e.target, e.depth, bool(e.lasti)) for e in parse(code)]


class BreakHere(Exception):
    """The root frame reached the instruction where this capture must stop."""


Handler = Callable[["Frame", dis.Instruction], None]
HANDLERS: dict[str, Handler] = {}


def handles(*opnames: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        for name in opnames:
            HANDLERS[name] = fn
        return fn

    return register


_INSTRUCTIONS: dict[types.CodeType, tuple[list[dis.Instruction], dict[int, int]]] = {}


def forget_instructions() -> None:
    """Drop the decoded instructions of every code object (``kiln.reset``)."""
    _INSTRUCTIONS.clear()


def instructions(code: types.CodeType) -> tuple[list[dis.Instruction], dict[int, int]]:
    """The code's instructions (no caches) and the index of each offset, cached per code."""
    known = _INSTRUCTIONS.get(code)
    if known is None:
        listing = list(dis.get_instructions(code))
        known = (listing, {inst.offset: i for i, inst in enumerate(listing)})
        _INSTRUCTIONS[code] = known
    return known


class Frame:
    """One activation of ``code`` under symbolic execution."""

    def __init__(
        self,
        session: Session,
        code: types.CodeType,
        scope: dict[str, Any],
        local_values: dict[str, Any],
        *,
        function: types.FunctionType | None = None,
        cells: dict[str, Any] | None = None,
        parent: Frame | None = None,
    ) -> None:
        self.session = session
        self.code = code
        self.globals = scope
        builtins_ = scope.get("__builtins__", __builtins__)
        self.builtins = builtins_ if isinstance(builtins_, dict) else vars(builtins_)
        self.function = function
        self.locals: dict[str, Any] = dict(local_values)
        self.cells: dict[str, Any] = dict(cells or {})
        self.parent = parent
        self.stack: list[Any] = []
        self.instructions, self.index = instructions(code)
        self.pc = 0
        self.kw_names: tuple[str, ...] = ()
        self.exc_stack: list[Any] = []
        self.table = exception_table(code)
        self.returned = False
        self.return_value: Any = None
        self.yielded: list[Any] | None = None  # set for generator frames run to exhaustion
        self.entered: dict[int, Any] = {}  # id(__exit__ on the stack) -> context manager
        self.location: SourceLocation | None = None
        self.line = -1
        self.current: dis.Instruction | None = None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    # --- stack -----------------------------------------------------------------------------
    def push(self, value: Any) -> None:
        self.stack.append(value)

    def pop(self) -> Any:
        return self.stack.pop()

    def popn(self, count: int) -> list[Any]:
        if count == 0:
            return []
        items = self.stack[-count:]
        del self.stack[-count:]
        return items

    def top(self, depth: int = 1) -> Any:
        return self.stack[-depth]

    def jump(self, offset: int) -> None:
        self.pc = self.index[offset]

    # --- running ---------------------------------------------------------------------------
    def run(self) -> Any:
        """Execute until the frame returns; the return value (or raise the frame's exception)."""
        session = self.session
        while not self.returned:
            inst = self.instructions[self.pc]
            self.current = inst
            if self.is_root and inst.offset == session.break_at:
                raise BreakHere
            self.pc += 1
            self._locate(inst)
            handler = HANDLERS.get(inst.opname)
            if handler is None:
                raise GraphBreak(
                    BreakReason.UNSUPPORTED_BYTECODE, f"opcode {inst.opname}", self.location
                )
            try:
                handler(self, inst)
            except GraphBreak as error:
                if error.location is None:
                    error.location = self.location
                raise
            except OpaqueCallError as error:  # a torch call no graph node can hold
                raise GraphBreak(
                    BreakReason.UNSUPPORTED_CALL, error.message, self.location
                ) from error
            except TraceError as error:  # a proxy's data was needed (bool(), item(), ...)
                raise GraphBreak(
                    BreakReason.DATA_DEPENDENT, error.message.split("(")[0].strip(), self.location
                ) from error
            except BreakHere:
                raise
            except Exception as error:
                self.handle_exception(inst, error)
            self.restore_location()  # an inlined call moved the user location
        return self.return_value

    def handle_exception(self, inst: dis.Instruction, error: BaseException) -> None:
        """Send ``error`` to the handler covering ``inst``, or out of the frame."""
        for entry in self.table:
            if entry.start <= inst.offset < entry.end:
                del self.stack[entry.depth :]
                if entry.lasti:
                    self.push(inst.offset)
                self.push(error)
                self.jump(entry.target)
                return
        raise error

    def _locate(self, inst: dis.Instruction) -> None:
        line = inst.positions.lineno if inst.positions is not None else None
        if line is not None and line != self.line:
            self.line = line
            filename = self.code.co_filename
            self.location = SourceLocation(
                filename, line, linecache.getline(filename, line).strip()
            )
            set_user_location(self.location)

    def restore_location(self) -> None:
        if self.location is not None:
            set_user_location(self.location)

    def covering_entry(self, offset: int) -> ExceptionEntry | None:
        for entry in self.table:
            if entry.start <= offset < entry.end:
                return entry
        return None
