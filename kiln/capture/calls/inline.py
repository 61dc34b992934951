"""Inlining: a Python function's bytecode run symbolically in a child frame, with its
arguments bound as CPython binds them; and constructing objects (value types natively, other
user classes with ``__init__`` inlined).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from typing import Any

import torch

from kiln.capture.core.breaks import BreakReason, GraphBreak
from kiln.capture.core.frame import Frame
from kiln.capture.core.iteration import SymbolicIterator
from kiln.capture.core.session import Recipe

CO_GENERATOR = inspect.CO_GENERATOR


CO_ASYNC = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


MAX_DEPTH = 48


def inline(
    frame: Frame, fn: types.FunctionType, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run a Python function's bytecode symbolically in a child frame."""
    session = frame.session
    code = fn.__code__
    if code.co_flags & CO_ASYNC:
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"coroutine {fn.__qualname__}")
    if session.inline_depth >= MAX_DEPTH:
        raise GraphBreak(BreakReason.INLINE_DEPTH, f"{fn.__qualname__} nested {MAX_DEPTH} deep")
    local_values = bind_arguments(session, fn, args, kwargs)
    cells = dict(zip(code.co_freevars, fn.__closure__ or (), strict=True))
    child = Frame(
        session, code, fn.__globals__, local_values, function=fn, cells=cells, parent=frame
    )
    session.inline_depth += 1
    try:
        if code.co_flags & CO_GENERATOR:
            child.yielded = []
            child.run()
            return session.new(SymbolicIterator(child.yielded))
        return child.run()
    finally:
        session.inline_depth -= 1
        frame.restore_location()


def bind_arguments(
    session: Any, fn: types.FunctionType, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The callee's locals for ``fn(*args, **kwargs)``, bound as CPython binds them (including
    comprehension code's ``.0`` argument); a TypeError like CPython's otherwise."""
    code = fn.__code__
    names = code.co_varnames
    count = code.co_argcount
    keyword_count = code.co_kwonlyargcount
    has_varargs = bool(code.co_flags & 0x04)
    has_varkw = bool(code.co_flags & 0x08)
    qualname = fn.__qualname__
    local_values: dict[str, Any] = {}
    for name, value in zip(names[:count], args, strict=False):
        local_values[name] = value
    extra = args[count:]
    if extra and not has_varargs:
        raise TypeError(
            f"{qualname}() takes {count} positional argument{'s' if count != 1 else ''} "
            f"but {len(args)} were given"
        )
    keyword_names = names[count : count + keyword_count]
    varkw: dict[str, Any] = {}
    posonly = set(names[: code.co_posonlyargcount])
    for key, value in kwargs.items():
        if key in posonly or (key not in names[:count] and key not in keyword_names):
            if not has_varkw:
                raise TypeError(f"{qualname}() got an unexpected keyword argument '{key}'")
            varkw[key] = value
        elif key in local_values:
            raise TypeError(f"{qualname}() got multiple values for argument '{key}'")
        else:
            local_values[key] = value
    defaults = fn.__defaults__ or ()
    first_default = count - len(defaults)
    for i, name in enumerate(names[:count]):
        if name not in local_values:
            if i < first_default:
                raise TypeError(f"{qualname}() missing required positional argument: '{name}'")
            local_values[name] = defaults[i - first_default]
    kwdefaults = fn.__kwdefaults__ or {}
    for name in keyword_names:
        if name not in local_values:
            if name not in kwdefaults:
                raise TypeError(f"{qualname}() missing required keyword-only argument: '{name}'")
            local_values[name] = kwdefaults[name]
    index = count + keyword_count
    if has_varargs:
        local_values[names[index]] = session.new(tuple(extra))
        index += 1
    if has_varkw:
        local_values[names[index]] = session.new(varkw)
    return local_values


# Classes constructed natively (their constructors only store values).
_VALUE_CLASSES: tuple[type, ...] = (
    torch.Size,
    torch.device,
    torch.no_grad,
    torch.enable_grad,
    torch.set_grad_enabled,
    torch.inference_mode,
    torch.autocast,
    slice,
    range,
    functools.partial,
)


_CONTAINER_MODULES = (
    torch.nn.ModuleList,
    torch.nn.Sequential,
    torch.nn.ModuleDict,
    torch.nn.ParameterList,
    torch.nn.ParameterDict,
)


def construct(frame: Frame, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``cls(*args, **kwargs)`` during capture."""
    session = frame.session
    if issubclass(cls, BaseException) or cls in (object, int, float, bool, complex, bytes):
        for value in (*args, *kwargs.values()):
            if session.opaque(value):  # float(array)
                what = f"{cls.__name__}() of a {type(value).__name__} read from outside"
                raise GraphBreak(BreakReason.UNSUPPORTED_CALL, what)
        return cls(*args, **kwargs)  # a proxy argument raises: a data-dependent break
    if cls in _CONTAINER_MODULES:  # e.g. ModuleList slicing builds a new container
        return session.new(cls(*args, **kwargs), Recipe(cls, args, kwargs))
    if issubclass(cls, torch.nn.Module) and cls.__module__.startswith("torch.nn."):
        return _stateless_module(frame, cls, args, kwargs)
    if issubclass(cls, torch.nn.Module) or issubclass(cls, torch.Tensor):
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"constructing {cls.__qualname__}")
    if _native_constructor(cls):
        obj = cls(*args, **kwargs)
        return session.new(obj, Recipe(cls, args, kwargs))
    new = cls.__new__
    if new is not object.__new__:
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"{cls.__qualname__}.__new__")
    obj = object.__new__(cls)
    session.new(obj, Recipe(object.__new__, (cls,), {}))
    init = cls.__init__
    if isinstance(init, types.FunctionType):
        inline(frame, init, (obj, *args), kwargs)
    elif init is not object.__init__:
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"{cls.__qualname__}.__init__")
    elif args or kwargs:
        raise TypeError(f"{cls.__qualname__}() takes no arguments")
    return obj


def _stateless_module(
    frame: Frame, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A torch.nn module made inside the code (``CrossEntropyLoss(ignore_index=-100)`` in a
    forward): constructed natively and re-created from its recipe, when it holds no tensors.
    One with parameters or buffers (fresh random weights on every eager call) breaks."""
    if any(isinstance(v, torch.Tensor) for v in (*args, *kwargs.values())):
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"constructing {cls.__qualname__}")
    module = cls(*args, **kwargs)
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"constructing {cls.__qualname__}")
    return frame.session.new(module, Recipe(cls, args, kwargs))


def _native_constructor(cls: type) -> bool:
    if issubclass(cls, _VALUE_CLASSES) or dataclasses.is_dataclass(cls):
        return True
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return True  # namedtuple
    return issubclass(cls, dict) or cls.__module__.startswith("torch")
