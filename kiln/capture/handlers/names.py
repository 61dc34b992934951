"""Opcode handlers for names: globals, attributes, closure cells, ``super`` and imports.

Reads from outside the frame are wrapped with their source (``G['torch']``,
``L['self']._modules['fc']``), which installs the guard they need. Module attributes read
through ``_parameters``/``_buffers``/``_modules`` get those dict paths as sources (cheap to
re-check). Python ``property`` getters are inlined, so what they read is guarded too.
"""

from __future__ import annotations

import dis
import types
from typing import Any

import torch

from kiln.capture.core.breaks import BreakReason, GraphBreak
from kiln.capture.core.frame import NULL, PY, Frame, handles
from kiln.capture.guards.sources import Attr, Builtin, Closure, Constant, Global, Item, Source
from kiln.frontends.proxy import ProxyTensor

# Library modules whose attributes are taken as fixed (not guarded on every read).
_TRUSTED_MODULES = frozenset(
    {
        "torch",
        "math",
        "operator",
        "functools",
        "itertools",
        "collections",
        "typing",
        "builtins",
        "inspect",
        "warnings",
        "dataclasses",
        "enum",
        "contextlib",
        "numbers",
        "abc",
        "types",
        "copy",
        "transformers",
        "torchvision",
        "timm",
    }
)


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


def get_attribute(frame: Frame, obj: Any, name: str) -> Any:
    """``obj.name`` during capture: guarded when ``obj`` has a source, properties inlined."""
    from kiln.capture.calls.dispatch import call_function

    session = frame.session
    if isinstance(obj, torch.Tensor):
        if name in _AUTOGRAD_STATE:
            return _autograd_state(frame, obj, name)
        return getattr(obj, name)
    source = session.source_of(obj)
    if isinstance(obj, types.ModuleType):
        value = getattr(obj, name)
        if source is not None and obj.__name__.split(".")[0] not in _TRUSTED_MODULES:
            return session.wrap(value, Attr(source, name))
        if source is not None and not session.is_new(value):
            session.remember(value, Attr(source, name))
        return value
    descriptor = _class_attribute(obj, name)
    if isinstance(descriptor, property) and isinstance(descriptor.fget, types.FunctionType):
        from kiln.capture.calls.dispatch import _runs_natively

        if not _runs_natively(descriptor.fget):
            return call_function(frame, descriptor.fget, (obj,), {})
    if isinstance(obj, torch.nn.Module):
        return _module_attribute(frame, obj, name, source)
    value = getattr(obj, name)
    if source is None or session.is_new(obj) or ("attribute", id(obj), name) in session.effects:
        return value  # (an attribute this frame wrote holds the frame's own value: no guard)
    if isinstance(value, types.MethodType) and value.__self__ is obj:
        return value  # a method of obj's (guarded) class
    if isinstance(value, types.BuiltinMethodType) and getattr(value, "__self__", None) is obj:
        return value
    return session.wrap(value, Attr(source, name))


# Tensor attributes that belong to autograd rather than to the value.
_AUTOGRAD_STATE = frozenset({"grad", "grad_fn", "is_leaf", "_base", "data"})


def _autograd_state(frame: Frame, proxy: Any, name: str) -> Any:
    """``x.grad`` and friends: read off the caller's tensor for inputs (guarded); for computed
    tensors, what eager would say (no ``.grad``, not a leaf when it requires grad)."""
    session = frame.session
    if not isinstance(proxy, ProxyTensor):  # a real tensor from a native iterator: no source
        raise GraphBreak(
            BreakReason.UNSUPPORTED_CALL, f"tensor.{name} of a tensor without a source"
        )
    source = session.source_of(proxy) if hasattr(proxy, "_input_type") else None
    real = session.caller_tensor(proxy)
    if name == "data":  # a view of the same memory that autograd does not track
        return proxy.detach()
    if real is not None and source is not None and proxy._mutations == 0:
        with torch._C.DisableTorchFunction():  # (capture's own guarded read, not torch code's)
            value = getattr(real, name)
        return session.wrap(value, Attr(source, name))
    if name == "grad":
        return None
    if name == "is_leaf":
        return not proxy.requires_grad
    raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"tensor.{name} of a computed tensor")


def _class_attribute(obj: Any, name: str) -> Any:
    for klass in type(obj).__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None


def _module_attribute(
    frame: Frame, module: torch.nn.Module, name: str, source: Source | None
) -> Any:
    session = frame.session
    state = module.__dict__
    for slot in ("_parameters", "_buffers", "_modules"):
        table = state.get(slot)
        if table is not None and name in table and name not in state:
            value = table[name]
            if source is None or session.is_new(module):
                return value
            return session.wrap(value, Item(Attr(source, slot), name))
    value = getattr(module, name)
    if (
        source is None
        or session.is_new(module)
        or ("attribute", id(module), name) in session.effects
    ):
        return value
    if isinstance(value, types.MethodType) and value.__self__ is module and name not in state:
        return value
    return session.wrap(value, Attr(source, name))


@handles("STORE_ATTR")
def store_attr(frame: Frame, inst: dis.Instruction) -> None:
    obj = frame.pop()
    value = frame.pop()
    set_attribute(frame, obj, inst.argval, value)


def set_attribute(frame: Frame, obj: Any, name: str, value: Any) -> None:
    if isinstance(obj, torch.Tensor):
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"setting tensor attribute {name!r}")
    descriptor = _class_attribute(obj, name)
    if isinstance(descriptor, property) and isinstance(descriptor.fset, types.FunctionType):
        from kiln.capture.calls.dispatch import call_function

        call_function(frame, descriptor.fset, (obj, value), {})
        return
    frame.session.set_attribute(obj, name, value)


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


def zero_arg_super(frame: Frame) -> Any:
    """``super()`` with no arguments: the frame's ``__class__`` cell and first argument."""
    cell = frame.cells.get("__class__")
    if cell is None or frame.code.co_argcount == 0:
        raise RuntimeError("super(): no arguments")
    first = frame.code.co_varnames[0]
    self_ = frame.locals.get(first)
    if self_ is None and first in frame.cells:
        self_ = frame.cells[first].cell_contents
    return super(cell.cell_contents, self_)


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
