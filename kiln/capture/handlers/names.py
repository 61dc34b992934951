"""Opcode handlers for names: globals, attributes, closure cells, ``super`` and imports.

Reads from outside the frame are wrapped with their source (``G['torch']``, a closure cell),
which installs the guard they need; attribute reads and writes go through
``kiln.capture.calls.attributes`` (guarded paths, ``property`` code inlined).
"""

from __future__ import annotations

import dis
import types
from typing import Any

from kiln.capture.calls.attributes import get_attribute, set_attribute
from kiln.capture.core.breaks import BreakReason, GraphBreak
from kiln.capture.core.frame import NULL, PY, Frame, handles
from kiln.capture.guards.sources import Attr, Builtin, Closure, Constant, Global, Source


# --- globals ----------------------------------------------------------------------------
@handles("LOAD_GLOBAL")
def load_global(frame: Frame, inst: dis.Instruction) -> None:
    name = inst.argval
    push_null = bool((inst.arg or 0) & 1)
    if push_null and PY < (3, 13):
        frame.push(NULL)
    frame.push(load_global_value(frame, name))
    if push_null and PY >= (3, 13):
        frame.push(NULL)


def load_global_value(frame: Frame, name: str) -> Any:
    session = frame.session
    if ("global", id(frame.globals), name) in session.effects:
        if name not in frame.globals:
            raise NameError(f"name '{name}' is not defined")
        return frame.globals[name]  # written by this frame: its own value, no guard
    if name in frame.globals:
        return session.wrap(frame.globals[name], Global(name, frame.globals))
    if name in frame.builtins:
        return session.wrap(frame.builtins[name], Builtin(name))
    raise NameError(f"name '{name}' is not defined")


@handles("LOAD_NAME")
def load_name(frame: Frame, inst: dis.Instruction) -> None:
    if inst.argval in frame.locals:
        frame.push(frame.locals[inst.argval])
    else:
        frame.push(load_global_value(frame, inst.argval))


@handles("STORE_GLOBAL")
def store_global(frame: Frame, inst: dis.Instruction) -> None:
    frame.session.set_global(frame.globals, inst.argval, frame.pop())


@handles("DELETE_GLOBAL")
def delete_global(frame: Frame, inst: dis.Instruction) -> None:
    if inst.argval not in frame.globals:
        raise NameError(f"name '{inst.argval}' is not defined")
    frame.session.set_global(frame.globals, inst.argval, None, delete=True)


# --- attributes -------------------------------------------------------------------------
@handles("LOAD_ATTR")
def load_attr(frame: Frame, inst: dis.Instruction) -> None:
    obj = frame.pop()
    method = PY >= (3, 12) and bool((inst.arg or 0) & 1)
    value = get_attribute(frame, obj, inst.argval)
    if method:
        _push_method(frame, value)
    else:
        frame.push(value)


@handles("LOAD_METHOD")
def load_method(frame: Frame, inst: dis.Instruction) -> None:
    _push_method(frame, get_attribute(frame, frame.pop(), inst.argval))


def _push_method(frame: Frame, value: Any) -> None:
    """Push a looked-up method in its "NULL + callable" form (valid in every version)."""
    if PY >= (3, 13):
        frame.push(value)
        frame.push(NULL)
    else:
        frame.push(NULL)
        frame.push(value)


@handles("STORE_ATTR")
def store_attr(frame: Frame, inst: dis.Instruction) -> None:
    obj = frame.pop()
    value = frame.pop()
    set_attribute(frame, obj, inst.argval, value)


@handles("DELETE_ATTR")
def delete_attr(frame: Frame, inst: dis.Instruction) -> None:
    obj = frame.pop()
    frame.session.set_attribute(obj, inst.argval, None, delete=True)


# --- cells ------------------------------------------------------------------------------
@handles("MAKE_CELL")
def make_cell(frame: Frame, inst: dis.Instruction) -> None:
    name = inst.argval
    cell = types.CellType()
    if name in frame.locals:
        cell.cell_contents = frame.locals.pop(name)
    frame.cells[name] = frame.session.new(cell)


@handles("LOAD_CLOSURE")
def load_closure(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(frame.cells[inst.argval])


@handles("LOAD_DEREF")
def load_deref(frame: Frame, inst: dis.Instruction) -> None:
    name = inst.argval
    cell = frame.cells[name]
    try:
        value = cell.cell_contents
    except ValueError:
        raise NameError(
            f"cannot access free variable '{name}' where it is not associated with a value"
        ) from None
    session = frame.session
    if session.is_new(cell) or ("cell", id(cell)) in session.effects:
        frame.push(value)
        return
    frame.push(session.wrap(value, _cell_source(frame, name, cell)))


def _cell_source(frame: Frame, name: str, cell: Any) -> Source:
    if frame.is_root and name in frame.code.co_freevars:
        return Closure(frame.code.co_freevars.index(name), name)
    known = frame.session.source_of(cell)  # e.g. a cell passed to a resume function
    return Attr(known if known is not None else Constant(cell), "cell_contents")


@handles("STORE_DEREF")
def store_deref(frame: Frame, inst: dis.Instruction) -> None:
    frame.session.set_cell(frame.cells[inst.argval], frame.pop())


@handles("DELETE_DEREF")
def delete_deref(frame: Frame, inst: dis.Instruction) -> None:
    cell = frame.cells[inst.argval]
    if not frame.session.is_new(cell):
        raise GraphBreak(BreakReason.UNSUPPORTED_BYTECODE, "del of a closure variable")
    del cell.cell_contents


# --- super and imports ------------------------------------------------------------------
@handles("LOAD_SUPER_ATTR")
def load_super_attr(frame: Frame, inst: dis.Instruction) -> None:
    self_ = frame.pop()
    cls = frame.pop()
    frame.pop()  # the global `super`
    value = get_attribute(frame, super(cls, self_), inst.argval)
    if (inst.arg or 0) & 1:
        _push_method(frame, value)
    else:
        frame.push(value)


@handles("IMPORT_NAME")
def import_name(frame: Frame, inst: dis.Instruction) -> None:
    fromlist = frame.pop()
    level = frame.pop()
    frame.push(__import__(inst.argval, frame.globals, None, fromlist, level))


@handles("IMPORT_FROM")
def import_from(frame: Frame, inst: dis.Instruction) -> None:
    module = frame.top()
    try:
        frame.push(getattr(module, inst.argval))
    except AttributeError:
        raise ImportError(f"cannot import name '{inst.argval}'") from None
