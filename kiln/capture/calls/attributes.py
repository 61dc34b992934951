"""Attribute access during capture: reads guarded through their sources, ``property`` getters
and setters inlined, module state read through ``_parameters``/``_buffers``/``_modules``.

Reads from outside the frame are wrapped with their source (``L['self']._modules['fc']``),
which installs the guard they need; module attributes get the dict paths as sources (cheap to
re-check). A property getter is Python code, so what it reads is guarded too.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from kiln.capture.calls import registry
from kiln.capture.calls.native import runs_natively
from kiln.capture.core.breaks import BreakReason, GraphBreak
from kiln.capture.core.frame import Frame
from kiln.capture.guards.sources import Attr, Item, Source
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


def get_attribute(frame: Frame, obj: Any, name: str) -> Any:
    """``obj.name`` during capture: guarded when ``obj`` has a source, properties inlined."""
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
    fget = descriptor.fget if isinstance(descriptor, property) else None
    if isinstance(fget, types.FunctionType) and not runs_natively(fget):
        return registry.call_function(frame, fget, (obj,), {})
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


def set_attribute(frame: Frame, obj: Any, name: str, value: Any) -> None:
    if isinstance(obj, torch.Tensor):
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"setting tensor attribute {name!r}")
    descriptor = _class_attribute(obj, name)
    if isinstance(descriptor, property) and isinstance(descriptor.fset, types.FunctionType):
        registry.call_function(frame, descriptor.fset, (obj, value), {})
        return
    frame.session.set_attribute(obj, name, value)


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
